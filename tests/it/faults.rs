//! Faults a rack really has: here, a full disk. The state directory lives on a small
//! loop-mounted ext4 that fills up while machines join.

use crate::common::*;
use bca::proto::protocol::{Empty, Hello, Reply, Request};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A small ext4 file system, loop-mounted; unmounted when dropped.
struct SmallFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl SmallFs {
    fn new(mib: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        sh(&format!(
            "dd if=/dev/zero of={} bs=1M count={mib} status=none && mkfs.ext4 -q -F {} && mount -o loop {} {}",
            img.display(),
            img.display(),
            img.display(),
            mnt.display()
        ));
        SmallFs { _dir: dir, mnt }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

fn sh(cmd: &str) -> std::process::Output {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Writes zeros to `path` until the file system is full.
fn fill(path: &Path) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "dd if=/dev/zero of={} bs=64k status=none",
            path.display()
        ))
        .output()
        .unwrap();
}

fn healthz(a: &Appliance) -> (u16, serde_json::Value) {
    let (code, body) = curl(a, "/healthz", "GET");
    (code, serde_json::from_str(&body).unwrap_or_default())
}

#[test]
fn a_full_disk_answers_unavailable_loses_nothing_and_recovers_by_itself() {
    let fs = SmallFs::new(24);
    let mut a = Appliance::start();
    // The state directory moves onto the small file system.
    a.stop();
    let state = a.state();
    sh(&format!("cp -a {} {}/", state.display(), fs.mnt.display()));
    std::fs::remove_dir_all(&state).unwrap();
    std::os::unix::fs::symlink(fs.mnt.join("state"), &state).unwrap();
    a.serve(PASSPHRASE);
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 5000}));
    assert_eq!(healthz(&a).0, 200);

    // A node with a live session before the disk fills.
    let (raw, csr, key) = sim.join(&token, &machine());
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let body =
        bca::agent::verify_response(&sim.cfg, &reply.join_response.unwrap(), &csr, &key, "node")
            .unwrap();
    let mut issued = vec![{
        let leaf =
            bca::proto::x509::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0);
        bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex
    }];
    let chain: Vec<Vec<u8>> = body
        .certificate_chain
        .iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect();
    let rt = rt();
    let mut session = rt.block_on(async {
        let mut s = bca::agent::connect(&sim.cfg, Some((chain.clone(), key.pkcs8())))
            .await
            .unwrap();
        let hello = Request {
            v: 1,
            hello: Some(Hello::default()),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(&sim.cfg, &mut s, &serde_json::to_vec(&hello).unwrap())
            .await
            .unwrap();
        assert!(serde_json::from_slice::<Reply>(&raw)
            .unwrap()
            .welcome
            .is_some());
        s
    });

    // The disk fills up during a join storm: every answer is a certificate whose row is written,
    // or UNAVAILABLE.
    let filler = fs.mnt.join("filler");
    fill(&filler);
    let mut unavailable = 0;
    for _ in 0..40 {
        let (raw, csr, k) = sim.join(&token, &machine());
        let reply: Reply = serde_json::from_slice(&raw).unwrap();
        match (reply.join_response, reply.error) {
            (Some(r), _) => {
                let b = bca::agent::verify_response(&sim.cfg, &r, &csr, &k, "node").unwrap();
                let leaf = bca::proto::x509::pem_decode_all(&b.certificate_chain[0], "CERTIFICATE")
                    .remove(0);
                issued.push(bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex);
            }
            (None, Some(e)) => {
                assert_eq!(e.code, "UNAVAILABLE", "{}", e.message);
                unavailable += 1;
            }
            _ => panic!("{}", String::from_utf8_lossy(&raw)),
        }
    }
    assert!(unavailable > 0, "the disk never filled");

    // The admin API says why; /healthz fails its disk check; doctor says so.
    let e = a
        .api(
            "pools/create",
            json!({"tenantId": a.root_tenant(), "name": "more"}),
        )
        .unwrap_err();
    assert_eq!(e.code, bca::base::error::Code::Unavailable, "{e}");
    assert!(e.message.contains("disk is full"), "{e}");
    let (code, h) = healthz(&a);
    assert_eq!(code, 503, "{h}");
    assert_eq!(h["disk"]["ok"], false, "{h}");
    assert!(
        h["disk"]["problem"]
            .as_str()
            .unwrap()
            .contains("disk is full"),
        "{h}"
    );
    let o = a.cli(&["doctor"]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("FAIL disk: the state directory's disk is full"),
        "{out}"
    );
    // The session is still served (its heartbeat answered), and so is the well-known document.
    rt.block_on(async {
        let hb = Request {
            v: 1,
            heartbeat: Some(Empty {}),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(&sim.cfg, &mut session, &serde_json::to_vec(&hb).unwrap())
            .await
            .unwrap();
        assert!(serde_json::from_slice::<Reply>(&raw).unwrap().ack.is_some());
    });
    assert_eq!(
        curl(&a, "/api/compute/.well-known/better-compute", "GET").0,
        200
    );

    // Space freed: the appliance recovers by itself.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(healthz(&a).0, 200);
    let again = sim.admitted(&token, &machine());
    issued.push({
        let leaf =
            bca::proto::x509::pem_decode_all(&again.certificate_chain[0], "CERTIFICATE").remove(0);
        bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex
    });
    a.api_ok(
        "pools/create",
        json!({"tenantId": a.root_tenant(), "name": "more"}),
    );
    assert_eq!(healthz(&a).1["disk"]["ok"], true);

    // Nothing acknowledged was lost, uses spent equal nodes admitted, and the database is whole.
    for s in &issued {
        assert_eq!(
            a.count(&format!(
                "SELECT count(*) FROM node_certs WHERE serial = '{s}'"
            )),
            1,
            "an acknowledged certificate has no row"
        );
    }
    let nodes = a.count("SELECT count(*) FROM nodes");
    assert_eq!(nodes as usize, issued.len());
    assert_eq!(a.count("SELECT 5000 - uses_left FROM join_tokens"), nodes);
    let ok: String = a
        .db()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    a.stop();
    drop(a);
    drop(fs);
}
