//! The admin socket: `POST /api/compute/<group>/<method>` over a Unix socket, allowed to root,
//! the service's own user and the configured admin group, and decided by the admin API.

use crate::admin::ctx::Ctx;
use crate::admin::{self};
use crate::appliance::app::App;
use crate::appliance::rotation::Rotator;
use crate::base::error::ApiError;
use crate::edge::http::{builder, error, respond, well_known_path, Body};
use crate::proto::protocol::BASE_PATH;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio::sync::watch;

/// Who is on the other end of the admin socket.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
}

/// Root, the service's own uid, or a member (primary group) of the configured admin group.
pub fn admin_allowed(peer: Peer, own_uid: u32, admin_group: Option<u32>) -> bool {
    peer.uid == 0 || peer.uid == own_uid || admin_group.is_some_and(|g| g == peer.gid)
}

async fn admin(
    app: Arc<App>,
    rotator: Arc<Rotator>,
    peer: Peer,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    if !admin_allowed(peer, crate::base::fsutil::own_uid(), app.config.admin_group) {
        tracing::warn!(
            uid = peer.uid,
            gid = peer.gid,
            "admin socket: caller refused"
        );
        return Ok(error(&ApiError::access_denied(format!(
            "uid {} may not use the admin socket",
            peer.uid
        ))));
    }
    let path = req.uri().path().to_string();
    if path == well_known_path() {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return Ok(error(&ApiError::invalid_input(
                "use GET for the well-known document",
            )));
        }
        let doc = app
            .well_known
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        return Ok(respond(200, &doc));
    }
    let Some(method) = path
        .strip_prefix(&format!("{BASE_PATH}/"))
        .map(str::to_string)
    else {
        return Ok(error(&ApiError::not_found(format!(
            "no resource at {path}"
        ))));
    };
    if req.method() != Method::POST {
        return Ok(error(&ApiError::invalid_input(
            "admin methods are called with POST",
        )));
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(error(&ApiError::invalid_input(format!(
                "the request body is larger than {MAX_BODY} bytes"
            ))))
        }
    };
    let caller = format!("uid:{}", peer.uid);
    let res = tokio::task::spawn_blocking(move || {
        let ctx = Ctx {
            caller: &caller,
            now: crate::base::clock::now(),
            site_id: &app.config.site_id,
            root_tenant: &app.root_tenant,
            sessions: Some(app.sessions.as_ref()),
        };
        match method.as_str() {
            "health/get" => return crate::appliance::health::report(&app),
            "pki/status" => return crate::appliance::rotation::status(&app.state_dir),
            "pki/rotate" => {
                #[derive(serde::Deserialize)]
                #[serde(rename_all = "camelCase", deny_unknown_fields)]
                struct Rotate {
                    kind: String,
                    action: Option<String>,
                    overlap_seconds: Option<i64>,
                }
                let i: Rotate = crate::admin::ctx::parse(&body)?;
                let kind = crate::appliance::rotation::Kind::parse(&i.kind)?;
                return rotator.rotate(
                    &app,
                    kind,
                    i.action.as_deref(),
                    i.overlap_seconds,
                    ctx.caller,
                    ctx.now,
                );
            }
            "site/appliances/list" => {
                #[derive(serde::Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Empty {}
                crate::admin::ctx::parse::<Empty>(&body)?;
                return crate::appliance::members::list(&app.store, ctx.now);
            }
            "site/appliances/approve" | "site/appliances/remove" => {
                #[derive(serde::Deserialize)]
                #[serde(rename_all = "camelCase", deny_unknown_fields)]
                struct One {
                    id: String,
                    /// `approve`: the fingerprint the new box printed, which the operator checked.
                    fingerprint: Option<String>,
                }
                let i: One = crate::admin::ctx::parse(&body)?;
                if method.ends_with("approve") {
                    let Some(fp) = i.fingerprint.as_deref() else {
                        return Err(ApiError::invalid_input(
                            "fingerprint is required: the one `bca join-site` printed on the new box",
                        ));
                    };
                    return rotator.with_keys(|keys| {
                        crate::appliance::members::approve(
                            &app,
                            keys,
                            (&i.id, fp),
                            ctx.caller,
                            ctx.now,
                        )
                    });
                }
                return crate::appliance::members::remove(
                    &app.store,
                    &app.root_tenant,
                    &i.id,
                    ctx.caller,
                    ctx.now,
                );
            }
            _ => {}
        }
        crate::admin::downloads::dispatch(&app.store, &app.state_dir, &ctx, &method, &body)
            .unwrap_or_else(|| admin::dispatch(&app.store, &ctx, &method, &body))
    })
    .await;
    Ok(match res {
        Ok(Ok(v)) => respond(200, &v),
        Ok(Err(e)) => error(&e),
        Err(join) => error(&ApiError::internal(join)),
    })
}

pub async fn serve_admin(
    listener: UnixListener,
    app: Arc<App>,
    rotator: Arc<Rotator>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            acc = listener.accept() => {
                let Ok((stream, _)) = acc else { continue };
                let Ok(cred) = stream.peer_cred() else { continue };
                let peer = Peer { uid: cred.uid(), gid: cred.gid() };
                let (app, rotator) = (app.clone(), rotator.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| admin(app.clone(), rotator.clone(), peer, req));
                    let _ = builder().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        }
    }
}

/// The largest request body the admin socket reads (a bulk intake of a thousand machines fits).
pub const MAX_BODY: usize = 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_administer() {
        let p = |uid, gid| Peer { uid, gid };
        assert!(admin_allowed(p(0, 0), 1000, None));
        assert!(admin_allowed(p(1000, 1000), 1000, None));
        assert!(!admin_allowed(p(1001, 1001), 1000, None));
        assert!(admin_allowed(p(1001, 50), 1000, Some(50)));
        assert!(!admin_allowed(p(1001, 51), 1000, Some(50)));
    }
}
