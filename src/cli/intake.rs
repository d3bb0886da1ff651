//! Bulk intake for a rack arriving at once.
//!
//! `bca join-tokens create --from-csv FILE`: one pinned token per machine. The CSV has a header
//! naming its columns, among `name`, `serial`, `mac`, `productUuid` and `gpuUuid`; each row names
//! at least one identifier (the token's `expect`). `name` labels the machine (its token file and
//! its idempotency key `<--key>-<name>`); without it the serial, else the MAC, is the name. The
//! whole file is checked before anything is minted, the tokens are minted in one transaction
//! (`joinTokens/createMany`: all or none), and the secrets go to one 0600 file per machine
//! (`--out-dir`) or one 0600 CSV (`--out`), never to the terminal.
//!
//! `bca join-requests approve --all-matching --serial-prefix … --pool P --reason …`: approves
//! every pending request whose serial (or MAC) matches, each one a separate approval with its own
//! audit row, and reports each that failed.

use crate::base::error::{ApiError, ApiResult};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// One machine of the intake CSV.
#[derive(Debug, PartialEq, Eq)]
pub struct Machine {
    pub line: usize,
    pub name: String,
    pub expect: serde_json::Map<String, Value>,
}

const COLUMNS: &[(&str, &str)] = &[
    ("name", ""),
    ("serial", "serial"),
    ("mac", "mac"),
    ("productuuid", "productUuid"),
    ("product_uuid", "productUuid"),
    ("gpuuuid", "gpuUuid"),
    ("gpu_uuid", "gpuUuid"),
];

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && !n.starts_with('.')
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// Parses the intake CSV; every error names the file's line.
pub fn parse_csv(text: &str) -> Result<Vec<Machine>, String> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
    let (hline, header) = lines
        .next()
        .ok_or("the CSV is empty: it needs a header line such as name,serial,mac")?;
    let mut cols = Vec::new();
    for h in header.split(',') {
        let h = h.trim().to_ascii_lowercase();
        let Some((_, field)) = COLUMNS.iter().find(|(c, _)| *c == h) else {
            return Err(format!(
                "line {hline}: unknown column {h:?}; the columns are name, serial, mac, productUuid and gpuUuid"
            ));
        };
        if cols.contains(field) && !field.is_empty() || (field.is_empty() && cols.contains(&"")) {
            return Err(format!("line {hline}: column {h:?} appears twice"));
        }
        cols.push(*field);
    }
    if cols.iter().all(|c| c.is_empty()) {
        return Err(format!("line {hline}: the header names no identifier column (serial, mac, productUuid, gpuUuid)"));
    }
    let mut out: Vec<Machine> = Vec::new();
    for (n, l) in lines {
        if l.contains('"') {
            return Err(format!(
                "line {n}: quoted fields are not read; identifiers need no quotes"
            ));
        }
        let fields: Vec<&str> = l.split(',').map(str::trim).collect();
        if fields.len() != cols.len() {
            return Err(format!(
                "line {n}: {} fields, the header has {}",
                fields.len(),
                cols.len()
            ));
        }
        let mut name = None;
        let mut expect = serde_json::Map::new();
        for (c, v) in cols.iter().zip(&fields) {
            if v.is_empty() {
                continue;
            }
            if c.is_empty() {
                name = Some(v.to_string());
            } else {
                expect.insert(c.to_string(), json!(v));
            }
        }
        if expect.is_empty() {
            return Err(format!(
                "line {n}: the row names no identifier; a token must be pinned to its machine"
            ));
        }
        let name = name
            .or_else(|| {
                expect
                    .get("serial")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .or_else(|| {
                expect
                    .get("mac")
                    .and_then(Value::as_str)
                    .map(|m| m.replace(':', "-"))
            })
            .unwrap_or_default();
        if !valid_name(&name) {
            return Err(format!(
                "line {n}: name {name:?} must be 1 to 64 characters of [A-Za-z0-9._-], not starting with a dot"
            ));
        }
        if let Some(prev) = out.iter().find(|m| m.name == name) {
            return Err(format!(
                "line {n}: name {name} is also on line {}",
                prev.line
            ));
        }
        out.push(Machine {
            line: n,
            name,
            expect,
        });
    }
    if out.is_empty() {
        return Err("the CSV has a header and no machine".into());
    }
    if out.len() > crate::admin::tokens::MAX_BATCH_TOKENS {
        return Err(format!(
            "the CSV lists {} machines; one run mints at most {}",
            out.len(),
            crate::admin::tokens::MAX_BATCH_TOKENS
        ));
    }
    Ok(out)
}

/// Where the secrets go.
pub enum Output {
    Dir(PathBuf),
    Csv(PathBuf),
}

impl Output {
    /// The files this run would write; none may exist.
    fn paths(&self, machines: &[Machine]) -> Vec<PathBuf> {
        match self {
            Output::Dir(d) => machines
                .iter()
                .map(|m| d.join(format!("{}.token", m.name)))
                .collect(),
            Output::Csv(f) => vec![f.clone()],
        }
    }
}

/// The whole `--from-csv` run: check, mint, write.
pub fn create_from_csv(
    client: &crate::cli::client::Client,
    csv: &Path,
    out: Output,
    base: Value,
    key: &str,
) -> ApiResult<Value> {
    let text = std::fs::read_to_string(csv)
        .map_err(|e| ApiError::invalid_input(format!("cannot read {}: {e}", csv.display())))?;
    let machines =
        parse_csv(&text).map_err(|e| ApiError::invalid_input(format!("{}: {e}", csv.display())))?;
    for p in out.paths(&machines) {
        if std::fs::symlink_metadata(&p).is_ok() {
            return Err(ApiError::already_exists(format!(
                "{} exists; bulk intake never writes over a file (nothing was minted)",
                p.display()
            )));
        }
    }
    if let Output::Dir(d) = &out {
        if !d.exists() {
            crate::base::fsutil::create_private_dir(d).map_err(ApiError::invalid_input)?;
        }
        // Secrets go only into a directory that is ours and closed to everyone else.
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::symlink_metadata(d)
            .map_err(|e| ApiError::invalid_input(format!("{}: {e}", d.display())))?;
        if !m.is_dir()
            || m.uid() != crate::base::fsutil::own_uid()
            || m.permissions().mode() & 0o077 != 0
        {
            return Err(ApiError::invalid_input(format!(
                "--out-dir {} must be a directory of ours that only we can open (0700); nothing was minted",
                d.display()
            )));
        }
    }
    let mut body = base;
    body["tokens"] = machines
        .iter()
        .map(|m| json!({"idempotencyKey": format!("{key}-{}", m.name), "expect": m.expect}))
        .collect();
    eprintln!("minting {} tokens (one transaction)", machines.len());
    let answer = client.call("joinTokens/createMany", &body).map_err(|e| {
        // `tokens[N]: …` from the server becomes the CSV's line.
        let msg = e
            .message
            .strip_prefix("tokens[")
            .and_then(|r| r.split_once("]: "))
            .and_then(|(n, rest)| {
                let m = machines.get(n.parse::<usize>().ok()?)?;
                Some(format!(
                    "{} line {} ({}): {rest}",
                    csv.display(),
                    m.line,
                    m.name
                ))
            })
            .unwrap_or(e.message.clone());
        ApiError::new(e.code, format!("{msg} (nothing was minted)"))
    })?;
    let items = answer["items"].as_array().cloned().unwrap_or_default();
    let mut progress =
        crate::base::progress::Progress::new("writing token files", items.len() as u64);
    let mut records = Vec::new();
    // Sized up front (a token line is under 200 bytes): growing would free unwiped copies.
    let mut csv_out = zeroize::Zeroizing::new(String::with_capacity(64 + 256 * machines.len()));
    csv_out.push_str("name,tokenId,token\n");
    for (m, mut item) in machines.iter().zip(items) {
        let token = zeroize::Zeroizing::new(item["token"].as_str().unwrap_or_default().to_string());
        if let Some(o) = item.as_object_mut() {
            o.remove("token");
            o.insert("name".into(), json!(m.name));
        }
        match &out {
            Output::Dir(d) => {
                let p = d.join(format!("{}.token", m.name));
                let line = zeroize::Zeroizing::new(format!("{}\n", token.as_str()));
                crate::base::fsutil::write_new_private(&p, line.as_bytes()).map_err(|e| {
                    ApiError::already_exists(format!(
                        "{e}; the tokens were minted: revoke them (bca join-tokens list --pool …)"
                    ))
                })?;
            }
            Output::Csv(_) => {
                let row = zeroize::Zeroizing::new(format!(
                    "{},{},{}\n",
                    m.name,
                    item["id"].as_str().unwrap_or_default(),
                    token.as_str()
                ));
                csv_out.push_str(&row);
            }
        }
        records.push(item);
        progress.inc();
    }
    if let Output::Csv(f) = &out {
        crate::base::fsutil::write_new_private(f, csv_out.as_bytes()).map_err(|e| {
            ApiError::already_exists(format!("{e}; the tokens were minted: revoke them"))
        })?;
    }
    let wrote = match &out {
        Output::Dir(d) => format!("{} (one 0600 file per machine)", d.display()),
        Output::Csv(f) => format!("{} (0600)", f.display()),
    };
    eprintln!(
        "{} tokens minted; the secrets are in {wrote} and are not shown again",
        records.len()
    );
    Ok(json!({ "items": records }))
}

/// The pending requests that match the prefixes (every page).
pub fn matching_requests(
    client: &crate::cli::client::Client,
    tenant: &str,
    serial_prefix: Option<&str>,
    mac_prefix: Option<&str>,
) -> ApiResult<Vec<Value>> {
    let mut cursor: Option<String> = None;
    let mut out = Vec::new();
    loop {
        let v = client.call(
            "joinRequests/list",
            &json!({"tenantId": tenant, "state": "pending", "limit": 200, "cursor": cursor}),
        )?;
        for r in v["items"].as_array().into_iter().flatten() {
            let serials = &r["claims"]["serials"];
            let serial_ok = serial_prefix.is_none_or(|p| {
                ["product", "board", "chassis"]
                    .iter()
                    .filter_map(|k| serials[*k].as_str())
                    .any(|s| s.starts_with(p))
            });
            let mac_ok = mac_prefix.is_none_or(|p| {
                r["mac"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(&p.to_ascii_lowercase()))
            });
            if serial_ok && mac_ok {
                out.push(r.clone());
            }
        }
        match v["cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_is_checked_line_by_line() {
        let m = parse_csv(
            "# rack b7\nname,serial,mac\nu12,SN-1,\n,SN-2,aa:bb:cc:dd:ee:02\n,,aa:bb:cc:dd:ee:03\n",
        )
        .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].name, "u12");
        assert_eq!(m[1].name, "SN-2");
        assert_eq!(m[2].name, "aa-bb-cc-dd-ee-03");
        assert_eq!(m[1].line, 4);
        assert!(m[1].expect.contains_key("mac"));
        let e = |t: &str| parse_csv(t).unwrap_err();
        assert!(e("").contains("empty"));
        assert!(e("name,colour\n").contains("unknown column \"colour\""));
        assert!(e("name\nx\n").contains("no identifier column"));
        assert!(e("serial,mac\nSN-1\n").contains("line 2: 1 fields, the header has 2"));
        assert!(e("name,serial\nx,\n").contains("line 2: the row names no identifier"));
        assert!(e("name,serial\n../x,SN-1\n").contains("line 2: name \"../x\""));
        assert!(e("serial\nSN-1\nSN-1\n").contains("line 3: name SN-1 is also on line 2"));
        assert!(e("serial\n\"SN-1\"\n").contains("quoted"));
        assert!(e("serial,serial\n").contains("appears twice"));
        assert!(e("serial\n").contains("no machine"));
    }
}
