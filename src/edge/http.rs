//! The public HTTP listener on hyper: the well-known document, `/healthz`, `/metrics`, the boot
//! paths and the agent downloads; and the response helpers the admin socket
//! (`appliance::admin_http`) shares.

use crate::base::error::ApiError;
use crate::edge::{Answer, Ask, Edge};
use crate::proto::protocol::BASE_PATH;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Every answer's body: in memory, or a boot file streamed from disk.
pub type Body = http_body_util::Either<Full<Bytes>, crate::edge::boot::http::FileBody>;

pub(crate) fn full(b: Bytes) -> Body {
    http_body_util::Either::Left(Full::new(b))
}

pub(crate) fn respond(status: u16, v: &Value) -> Response<Body> {
    let mut body = serde_json::to_vec_pretty(v).expect("serializes");
    body.push(b'\n');
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .header("cache-control", "no-store")
        .body(full(Bytes::from(body)))
        .expect("a valid response")
}

pub(crate) fn error(e: &ApiError) -> Response<Body> {
    respond(e.code.http_status(), &crate::base::error::error_body(e))
}

pub(crate) fn well_known_path() -> String {
    format!("{BASE_PATH}/.well-known/better-compute")
}

/// Where a public request came from and arrived at.
type Addrs = (std::net::SocketAddr, Option<std::net::SocketAddr>);

/// The public listener: boot scripts and files, the well-known document, `/healthz`, `/metrics`
/// and agent downloads. It runs on the edge ([`crate::edge`]): what needs the database is asked
/// of the core.
async fn public(
    edge: Arc<Edge>,
    addrs: Addrs,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (peer, local) = addrs;
    if let Some(rest) = req.uri().path().strip_prefix(&format!("{BASE_PATH}/boot/")) {
        // HEAD for a file: UEFI HTTP boot asks the boot file's size first. Never for a script or
        // a per-boot archive, which a GET mints or spends.
        if req.method() == Method::HEAD && rest.starts_with("files/") {
            let name = &rest["files/".len()..];
            return Ok(match crate::edge::boot::http::file_len(&edge, name) {
                Some(len) => Response::builder()
                    .status(200)
                    .header("content-type", "application/octet-stream")
                    .header("content-length", len)
                    .body(full(Bytes::new()))
                    .expect("a valid response"),
                None => error(&ApiError::not_found(format!("no boot resource {rest}"))),
            });
        }
        if req.method() != Method::GET {
            return Ok(error(&ApiError::invalid_input(
                "use GET for boot scripts and archives (HEAD only for files/)",
            )));
        }
        let query = req.uri().query().unwrap_or("").to_string();
        crate::base::metrics::get()
            .boot_http_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let text = |status: u16, body: String| {
            Response::builder()
                .status(status)
                .header("content-type", "text/plain")
                .body(full(Bytes::from(body)))
                .expect("a valid response")
        };
        return Ok(
            match crate::edge::boot::http::handle(&edge, rest, &query, peer, local).await {
                crate::edge::boot::http::BootAnswer::Text(t) => text(200, t),
                // An iPXE script still: the machine's console says why.
                crate::edge::boot::http::BootAnswer::Forbidden(m) => {
                    text(403, format!("#!ipxe\necho {m}\nexit 1\n"))
                }
                crate::edge::boot::http::BootAnswer::TooMany(m) => {
                    text(429, format!("#!ipxe\necho bca: {m}\nexit 1\n"))
                }
                crate::edge::boot::http::BootAnswer::Bytes(b) => Response::builder()
                    .status(200)
                    .header("content-type", "application/octet-stream")
                    .body(full(Bytes::from(b)))
                    .expect("a valid response"),
                crate::edge::boot::http::BootAnswer::Stream(f) => Response::builder()
                    .status(200)
                    .header("content-type", "application/octet-stream")
                    .header("content-length", f.len())
                    .body(http_body_util::Either::Right(f))
                    .expect("a valid response"),
                crate::edge::boot::http::BootAnswer::NotFound => {
                    error(&ApiError::not_found(format!("no boot resource {rest}")))
                }
                crate::edge::boot::http::BootAnswer::Unavailable(m) => {
                    error(&ApiError::new(crate::base::error::Code::Unavailable, m))
                }
            },
        );
    }
    if matches!(req.uri().path(), "/healthz" | "/metrics") {
        // The counters and the full report are for the box itself (and a scraper the operator
        // names with `[health] metrics_public = true`); anyone else gets the status alone.
        let trusted = metrics_allowed(edge.metrics_public, peer.ip());
        if req.method() != Method::GET {
            return Ok(error(&ApiError::invalid_input(format!(
                "use GET for {}",
                req.uri().path()
            ))));
        }
        let metrics = req.uri().path() == "/metrics";
        if metrics && !trusted {
            return Ok(error(&ApiError::not_found(
                "no resource at /metrics (served to loopback, or set [health] metrics_public)",
            )));
        }
        let ask = if metrics {
            // The edge's own counters, when it is a process apart from the core.
            let own = edge
                .core
                .remote()
                .then(|| crate::base::metrics::get().edge_counts());
            Ask::Metrics { edge: own }
        } else {
            Ask::Health { trusted }
        };
        return Ok(match edge.core.ask(ask).await {
            Answer::Page { status, body } => Response::builder()
                .status(status)
                .header(
                    "content-type",
                    if metrics {
                        "text/plain; version=0.0.4"
                    } else {
                        "application/json"
                    },
                )
                .header("cache-control", "no-store")
                .body(full(Bytes::from(body)))
                .expect("a valid response"),
            Answer::Unavailable { message } => error(&ApiError::new(
                crate::base::error::Code::Unavailable,
                message,
            )),
            _ => error(&ApiError::internal("the core gave no page")),
        });
    }
    if req.uri().path() == well_known_path() {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return Ok(error(&ApiError::invalid_input(
                "use GET for the well-known document",
            )));
        }
        return Ok(match edge.core.ask(Ask::WellKnown).await {
            Answer::Json { value } => respond(200, &value),
            Answer::Unavailable { message } => error(&ApiError::new(
                crate::base::error::Code::Unavailable,
                message,
            )),
            _ => error(&ApiError::internal("the core gave no document")),
        });
    }
    if req.uri().path() == format!("{BASE_PATH}/downloads/manifest") {
        if req.method() != Method::GET {
            return Ok(error(&ApiError::invalid_input(
                "use GET for the release manifest",
            )));
        }
        return Ok(match edge.core.ask(Ask::ReleaseManifest).await {
            Answer::Text { text } => Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "text/plain; charset=utf-8")
                .header("cache-control", "no-store")
                .body(full(Bytes::from(text)))
                .expect("a valid response"),
            Answer::Unavailable { message } => error(&ApiError::new(
                crate::base::error::Code::Unavailable,
                message,
            )),
            _ => error(&ApiError::internal("the core gave no manifest")),
        });
    }
    let downloads = format!("{BASE_PATH}/downloads/bcd/");
    if let Some((version, arch)) = req
        .uri()
        .path()
        .strip_prefix(&downloads)
        .and_then(crate::domain::downloads::parse_rest)
    {
        if req.method() != Method::GET {
            return Ok(error(&ApiError::invalid_input("use GET for downloads")));
        }
        let sha = match edge
            .core
            .ask(Ask::DownloadSha {
                version: version.clone(),
                arch: arch.clone(),
            })
            .await
        {
            Answer::Sha { sha256 } => sha256,
            _ => None,
        };
        let Some(sha) = sha else {
            return Ok(error(&ApiError::not_found(format!(
                "no resource at {}",
                req.uri().path()
            ))));
        };
        // At most DOWNLOADS_AT_ONCE streamed at once (each a 64 KiB buffer and a descriptor).
        let Ok(permit) = downloads_at_once().clone().try_acquire_owned() else {
            return Ok(error(&ApiError::new(
                crate::base::error::Code::Unavailable,
                format!("{DOWNLOADS_AT_ONCE} downloads are being served; retry in a minute"),
            )));
        };
        let edge2 = edge.clone();
        let found = tokio::task::spawn_blocking(move || {
            crate::edge::http::open_verified(&edge2.downloads, &version, &arch, &sha)
        })
        .await
        .ok()
        .flatten()
        .and_then(|f| crate::edge::boot::http::FileBody::from_file(f, Some(permit)));
        if let Some(body) = found {
            return Ok(Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/octet-stream")
                .header("content-length", body.len())
                .body(http_body_util::Either::Right(body))
                .expect("a valid response"));
        }
    }
    Ok(error(&ApiError::not_found(format!(
        "no resource at {}",
        req.uri().path()
    ))))
}

/// Agent downloads streamed at once, at most.
pub const DOWNLOADS_AT_ONCE: usize = 32;

fn downloads_at_once() -> &'static std::sync::Arc<tokio::sync::Semaphore> {
    static S: std::sync::OnceLock<std::sync::Arc<tokio::sync::Semaphore>> =
        std::sync::OnceLock::new();
    S.get_or_init(|| std::sync::Arc::new(tokio::sync::Semaphore::new(DOWNLOADS_AT_ONCE)))
}

/// Whether a peer of the HTTP listener may read `/metrics` and the full `/healthz` report.
pub fn metrics_allowed(public: bool, peer: std::net::IpAddr) -> bool {
    let v4_mapped_loopback = match peer {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        _ => false,
    };
    public || peer.is_loopback() || v4_mapped_loopback
}

pub(crate) fn builder() -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .keep_alive(true);
    b
}

pub async fn serve_public(listener: TcpListener, edge: Arc<Edge>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            acc = listener.accept() => {
                let Ok((stream, peer)) = acc else { continue };
                let local = stream.local_addr().ok();
                let edge = edge.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| public(edge.clone(), (peer, local), req));
                    let _ = builder().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        }
    }
}

/// The file, opened beneath `<state-dir>/downloads` and rewound, when its content still has the
/// recorded SHA-256 (read once in chunks to check it: a file changed on disk is not served, and
/// no download is ever held in memory whole).
pub fn open_verified(
    root: &crate::base::fsutil::ReadRoot,
    version: &str,
    arch: &str,
    sha: &str,
) -> Option<std::fs::File> {
    use std::io::{Read, Seek};
    let rel = std::path::Path::new("bcd")
        .join(version)
        .join(format!("linux-{arch}"));
    let mut f = root.open_file(&rel).ok()?;
    if f.metadata().ok()?.len() > crate::domain::downloads::MAX_SIZE {
        return None;
    }
    let mut h = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = f.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    f.rewind().ok()?;
    (crate::base::crypto::hex(h.finish().as_ref()) == sha).then_some(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_read_metrics() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(metrics_allowed(false, ip("127.0.0.1")));
        assert!(metrics_allowed(false, ip("::1")));
        assert!(metrics_allowed(false, ip("::ffff:127.0.0.1")));
        assert!(!metrics_allowed(false, ip("10.0.0.7")));
        assert!(!metrics_allowed(false, ip("fe80::1")));
        assert!(metrics_allowed(true, ip("10.0.0.7")));
    }
}
