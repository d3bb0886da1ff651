//! Agent binaries the appliance serves to install scripts: `bca downloads add FILE --version V
//! --arch A` copies a file (brought on a stick to an air-gapped site) into
//! `<state-dir>/downloads/bcd/<version>/linux-<arch>` and records its SHA-256; the HTTP listener
//! serves it at `GET /api/compute/downloads/bcd/<version>/linux-<arch>`.

use std::path::{Path, PathBuf};

pub const ARCHES: &[&str] = &["amd64", "arm64"];
/// The largest file accepted.
pub const MAX_SIZE: u64 = 256 * 1024 * 1024;

/// `^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$`
pub fn valid_version(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b".+-".contains(c))
}

pub fn file_path(state_dir: &Path, version: &str, arch: &str) -> PathBuf {
    state_dir
        .join("downloads")
        .join("bcd")
        .join(version)
        .join(format!("linux-{arch}"))
}

/// `<version>/linux-<arch>` of `GET /api/compute/downloads/bcd/…`, when well-formed.
pub fn parse_rest(rest: &str) -> Option<(String, String)> {
    let (version, file) = rest.split_once('/')?;
    let arch = file.strip_prefix("linux-")?;
    (valid_version(version) && ARCHES.contains(&arch)).then(|| (version.into(), arch.into()))
}

/// The purpose string of a release manifest's signature.
pub const RELEASE_MANIFEST_PURPOSE: &str = "bca release-manifest v1";

/// A release manifest's signed part: its header, the site, and a line per agent binary
/// (`agent <version> <arch> <sha256>`), each line ending with a newline. The signature is over
/// [`RELEASE_MANIFEST_PURPOSE`], a zero byte, and these bytes.
pub fn manifest_body(site_id: &str, agents: &[(String, String, String)]) -> String {
    let mut out = format!("bca-release-manifest v1\nsite {site_id}\n");
    for (version, arch, sha) in agents {
        out.push_str(&format!("agent {version} {arch} {sha}\n"));
    }
    out
}

/// The manifest as served: the body, then `signer <base64 DER certificate>` and
/// `signature <base64 DER ECDSA>`.
pub fn manifest_text(body: &str, signer_b64: &str, sig_b64: &str) -> String {
    format!("{body}signer {signer_b64}\nsignature {sig_b64}\n")
}
