//! Crash consistency: a join storm is cut by SIGKILL at random moments, 50 times,
//! restarting the appliance each time. Afterwards: no token admitted more joins than its
//! `maxUses`, every certificate an agent received has its `node_certs` row and its node, no
//! acknowledged join is lost, the uses spent equal the nodes admitted, and `PRAGMA
//! integrity_check` is `ok`.

use crate::common::*;
use bca::protocol::Reply;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const KILLS: usize = 50;

fn kill9(a: &mut Appliance) {
    let mut c = a.child.take().unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &c.id().to_string()])
        .status();
    let _ = c.wait();
}

#[test]
fn fifty_kills_lose_nothing_and_overspend_nothing() {
    let mut a = Appliance::start();
    let pool = a.pool("p1");
    // Tokens with few uses, so that racing joins hit the limit.
    let tokens: Vec<(String, String, i64)> = (0..60)
        .map(|i| {
            let max = 1 + (i % 4) as i64;
            let (t, tok) = a.token(&pool, json!({"maxUses": max}));
            (t["id"].as_str().unwrap().to_string(), tok, max)
        })
        .collect();
    // (certificate serial, node id) of every acknowledged join or renewal.
    let acked: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..KILLS {
        let sim = Arc::new(Sim::new(&a));
        let mut hs = Vec::new();
        for k in 0..6 {
            let (sim, acked) = (sim.clone(), acked.clone());
            // Two joins per token in each round: they race for its last use.
            let token = tokens[(round * 3 + k / 2) % tokens.len()].1.clone();
            hs.push(std::thread::spawn(move || {
                let claims = machine();
                let Ok(raw) = sim.try_join(&token, &claims) else {
                    return; // the appliance died under this join
                };
                let (raw, csr, key) = raw;
                let Ok(reply) = serde_json::from_slice::<Reply>(&raw) else {
                    return;
                };
                let Some(resp) = reply.join_response else {
                    return;
                };
                let body = bca::agent::verify_response(&sim.cfg, &resp, &csr, &key, "node")
                    .expect("an answer that is not refused verifies");
                let der =
                    bca::pki::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0);
                let serial = bca::pki::parse_node_leaf(&der).unwrap().serial_hex;
                acked.lock().unwrap().push((serial, body.node_id));
            }));
        }
        // Cut the power somewhere in the storm.
        std::thread::sleep(Duration::from_millis(rand() % 120));
        kill9(&mut a);
        for h in hs {
            let _ = h.join();
        }
        let (http, gw) = (a.http.clone(), a.gateway.clone());
        a.serve_at(PASSPHRASE, &http, &gw);
    }
    let acked = acked.lock().unwrap().clone();
    assert!(
        !acked.is_empty(),
        "no join was ever acknowledged: the test measured nothing"
    );
    let db = a.db();
    let integrity: String = db
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    for (serial, node) in &acked {
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?1 AND n.id = ?2",
                [serial, node],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, 1, "acknowledged certificate {serial} of {node} was lost");
    }
    for (id, _, max) in &tokens {
        let uses_left: i64 = db
            .query_row(
                "SELECT uses_left FROM join_tokens WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            (0..=*max).contains(&uses_left),
            "{id}: uses_left {uses_left} of {max}"
        );
    }
    // Every node's certificates are a node's; no acknowledged join spent more than the tokens had.
    let total_max: i64 = tokens.iter().map(|t| t.2).sum();
    let nodes: i64 = db
        .query_row("SELECT count(*) FROM nodes", [], |r| r.get(0))
        .unwrap();
    assert!(
        nodes <= total_max,
        "{nodes} nodes from tokens worth {total_max} joins"
    );
    let spent: i64 = db
        .query_row(
            "SELECT sum(max_uses - uses_left) FROM join_tokens",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(spent, nodes, "uses spent and nodes admitted disagree");
    eprintln!(
        "{KILLS} kills survived; {} joins acknowledged; {nodes} nodes",
        acked.len()
    );
}
