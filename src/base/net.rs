//! What speaking HTTP and TLS needs on either side (the agent, the CLI, the appliance): the TLS
//! provider, URL parts, and a whole HTTP/1.1 response split into status and body.

use std::sync::Arc;

/// (status, body) of a whole HTTP/1.1 response with a content-length.
pub fn split_response(raw: &[u8]) -> Option<(u16, &[u8])> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = &raw[end + 4..];
    let len = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        })
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(body.len());
    body.get(..len).map(|b| (status, b))
}

/// The host of an `https://host[:port][/...]` URL.
pub fn url_host(url: &str) -> Option<String> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next()?;
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next()?.to_string()
    } else {
        authority
            .rsplit_once(':')
            .map(|(h, _)| h)
            .unwrap_or(authority)
            .to_string()
    };
    (!host.is_empty()).then_some(host)
}

/// Host and port of an `https://host[:port]` URL (443 by default).
/// Whether a URL is safe to write into a shell script, a TOML file or a heredoc as is: printable
/// ASCII, no space, no quote, backslash, `$` or backtick (an install script quotes it, and a
/// newline would end its heredoc).
pub fn url_is_plain(url: &str) -> bool {
    !url.is_empty()
        && url
            .bytes()
            .all(|c| c.is_ascii_graphic() && !matches!(c, b'\'' | b'"' | b'\\' | b'$' | b'`'))
}

pub fn host_port(url: &str) -> Option<(String, u16)> {
    let host = crate::base::net::url_host(url)?;
    let authority = url.strip_prefix("https://")?.split('/').next()?;
    let port = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && (!authority.starts_with('[') || h.ends_with(']')) => {
            p.parse().ok()?
        }
        _ => 443,
    };
    Some((host, port))
}

/// The rustls provider every TLS endpoint of bca uses: aws-lc-rs.
///
/// TLS 1.3's AES-128-GCM-SHA256 is preferred: its key schedule runs on SHA-256, which these
/// machines accelerate, where SHA-384 (AES-256-GCM's) cost 5% of a join in a profile. AES-256-GCM
/// and ChaCha20-Poly1305 stay available.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::aws_lc_rs::cipher_suite as cs;
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites = vec![
        cs::TLS13_AES_128_GCM_SHA256,
        cs::TLS13_AES_256_GCM_SHA384,
        cs::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ports() {
        assert_eq!(host_port("https://gw:8443"), Some(("gw".into(), 8443)));
        assert_eq!(host_port("https://gw"), Some(("gw".into(), 443)));
        assert_eq!(
            host_port("https://127.0.0.1:9/x"),
            Some(("127.0.0.1".into(), 9))
        );
        assert_eq!(host_port("https://[::1]:9"), Some(("::1".into(), 9)));
        assert_eq!(host_port("https://[::1]"), Some(("::1".into(), 443)));
        assert_eq!(host_port("https://gw:x"), None);
    }
}
