//! The core's answers to the edge's questions ([`Ask`]): in this process through [`LocalCore`],
//! or, under privilege separation, for the network child's questions that arrive over the
//! socketpair. Every question is checked here as any caller's would be.

use crate::appliance::app::App;
use crate::edge::{Answer, Ask, EdgeCore};
use std::sync::Arc;

/// The core in the edge's own process (privilege separation off).
pub struct LocalCore(pub Arc<App>);

impl EdgeCore for LocalCore {
    fn ask(&self, a: Ask) -> crate::proto::protocol::Pending<'_, Answer> {
        Box::pin(answer(&self.0, a))
    }
}

/// The core's side: answers one question. Blocking work runs off the runtime's workers.
pub async fn answer(app: &Arc<App>, a: Ask) -> Answer {
    let app2 = app.clone();
    match a {
        Ask::BootScript {
            mac,
            peer,
            base,
            grub,
        } => {
            use crate::appliance::boot::ScriptRefused;
            match crate::appliance::boot::script(app, &mac, &peer, &base, grub).await {
                Ok(text) => Answer::Text { text },
                Err(ScriptRefused::NotSighted(message)) => Answer::Forbidden { message },
                Err(ScriptRefused::Rate(message)) => Answer::TooMany { message },
                Err(ScriptRefused::Unavailable(message)) => Answer::Unavailable { message },
            }
        }
        Ask::WellKnown => Answer::Json {
            value: app
                .well_known
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        },
        Ask::BootArchive { nonce, peer } => Answer::Bytes {
            b64: crate::appliance::boot::take_archive(app, &nonce, &peer)
                .map(|a| crate::base::crypto::b64(&a)),
        },
        a => tokio::task::spawn_blocking(move || answer_blocking(&app2, a))
            .await
            .unwrap_or_else(|e| Answer::Unavailable {
                message: format!("the core failed: {e}"),
            }),
    }
}

fn answer_blocking(app: &Arc<App>, a: Ask) -> Answer {
    match a {
        Ask::DhcpAddress {
            mac,
            discover,
            relay,
        } => Answer::Address {
            ip: crate::proto::claims::loose_mac(&mac).and_then(|mac| {
                crate::appliance::boot::address(
                    app,
                    &mac,
                    discover,
                    relay,
                    crate::base::clock::now(),
                )
            }),
        },
        Ask::BootLease {
            mac,
            ip,
            relay,
            arch,
            stage,
            file,
        } => {
            let known = ["dhcp", "dhcp-ipxe"].contains(&stage.as_str());
            let ip = ip.filter(|i| i.parse::<std::net::IpAddr>().is_ok());
            let relay = relay.filter(|i| i.parse::<std::net::Ipv4Addr>().is_ok());
            let file = file.filter(|f| f.len() <= 255 && !f.contains(['\0', '\n']));
            if let (Some(mac), true) = (crate::proto::claims::loose_mac(&mac), known) {
                crate::appliance::boot::lease(
                    app,
                    &mac,
                    (ip, relay),
                    arch,
                    &stage,
                    file.as_deref(),
                );
            }
            Answer::Done
        }
        Ask::Health { trusted } => match crate::appliance::health::report(app) {
            Ok(v) => {
                // Load balancers and probes read the status code: 503 while failing.
                let status = if v["status"] == "failing" { 503 } else { 200 };
                let v = if trusted {
                    v
                } else {
                    serde_json::json!({"status": v["status"]})
                };
                let mut b = serde_json::to_string_pretty(&v).expect("serializes");
                b.push('\n');
                Answer::Page { status, body: b }
            }
            Err(e) => Answer::Unavailable { message: e.message },
        },
        Ask::Metrics { edge } => Answer::Page {
            status: 200,
            body: crate::base::metrics::get().render(app.sessions.len(), edge.as_ref()),
        },
        Ask::Sighting { mac, ip } => {
            if let Some(mac) = crate::proto::claims::loose_mac(&mac) {
                crate::appliance::boot::sighted(app, &mac, ip, crate::base::clock::now());
            }
            Answer::Done
        }
        Ask::DownloadSha { version, arch } => Answer::Sha {
            sha256: crate::store::downloads::recorded_sha(&app.store, &version, &arch),
        },
        Ask::ReleaseManifest => match release_manifest(app) {
            Ok(text) => Answer::Text { text },
            Err(message) => Answer::Unavailable { message },
        },
        Ask::BootScript { .. } | Ask::WellKnown | Ask::BootArchive { .. } => {
            unreachable!("answered on the runtime")
        }
    }
}

/// The signed release manifest: every recorded agent binary, signed now by the join-signing key.
fn release_manifest(app: &Arc<App>) -> Result<String, String> {
    let items = app
        .store
        .read(crate::store::downloads::list)
        .map_err(|e| e.message)?;
    let agents: Vec<(String, String, String)> = items
        .iter()
        .filter(|d| d["product"] == "bcd")
        .map(|d| {
            let s = |k: &str| d[k].as_str().unwrap_or_default().to_string();
            (s("version"), s("arch"), s("sha256"))
        })
        .collect();
    let join = app
        .join
        .get()
        .ok_or("the JoinService is not running: no key signs the manifest")?;
    let body = crate::domain::downloads::manifest_body(&app.site.config.site_id, &agents);
    let (sig, signer) = join.sign_release_manifest(&body);
    Ok(crate::domain::downloads::manifest_text(
        &body, &signer, &sig,
    ))
}
