//! What the commands print: tables for people, or the API's JSON with `--json`.

use super::conn::*;
use crate::base::error::{ApiError, ApiResult};
use serde_json::Value;
use std::path::Path;

/// `--out`: a token file is never written over; checked before anything is minted.
pub(crate) fn refuse_existing_out(path: &Path) -> ApiResult<()> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(ApiError::already_exists(format!(
            "{} exists; --out never writes over a file",
            path.display()
        )));
    }
    Ok(())
}

/// Writes a token just minted (`id`) to a new 0600 file; when that fails, the token exists all
/// the same, and the error says to revoke it.
pub(crate) fn write_token_file(path: &Path, token: &str, id: &str) -> ApiResult<()> {
    crate::base::fsutil::write_new_private(path, format!("{token}\n").as_bytes())
        .map_err(|e| ApiError::already_exists(format!("{e}; the token {id} was minted: revoke it")))
}

pub(crate) fn print(conn: &Conn, v: &Value, table: impl FnOnce(&Value)) {
    if conn.json {
        println!("{}", serde_json::to_string_pretty(v).expect("serializes"));
    } else {
        table(v);
    }
}

/// Prints rows as aligned columns.
pub fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    // Stored values may come from a machine: their control characters are shown, not obeyed.
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|c| crate::base::text::escape(&c).into_owned())
                .collect()
        })
        .collect();
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}

/// Prints a list answer: `--json` as the API's JSON, else a table of the given (header, field)
/// columns and the next cursor.
pub fn print_list(conn: &Conn, v: &Value, columns: &[(&str, &str)]) {
    print(conn, v, |v| {
        let headers: Vec<&str> = columns.iter().map(|(h, _)| *h).collect();
        print_table(
            &headers,
            items(v)
                .iter()
                .map(|item| columns.iter().map(|(_, k)| s(&item[*k])).collect())
                .collect(),
        );
        print_cursor(v);
    });
}

/// A value as the CLI prints it; a string's control characters escaped (`text`).
pub fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => crate::base::text::escape(s).into_owned(),
        other => other.to_string(),
    }
}

pub(crate) fn items(v: &Value) -> Vec<Value> {
    v["items"].as_array().cloned().unwrap_or_default()
}

pub fn print_cursor(v: &Value) {
    if let Some(c) = v["cursor"].as_str() {
        println!("more: --cursor {c}");
    }
}

pub(crate) fn print_record(v: &Value) {
    if let Some(o) = v.as_object() {
        for (k, val) in o {
            println!("{k:<14} {}", s(val));
        }
    }
}

pub(crate) fn pool_table(v: &Value) {
    print_table(
        &["ID", "NAME", "AGENT", "ATTESTORS", "ARCHIVED"],
        items(v)
            .iter()
            .map(|p| {
                vec![
                    s(&p["id"]),
                    s(&p["name"]),
                    s(&p["agent"]),
                    p["policy"]["joinAttestors"]
                        .as_array()
                        .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
                        .unwrap_or("all".into()),
                    s(&p["archivedAt"]),
                ]
            })
            .collect(),
    );
    print_cursor(v);
}
