//! Timing: a refusal does not reveal which check failed. The answer times of joins with an
//! unknown token id, a wrong secret and an expired token are measured over real TLS connections,
//! interleaved so that machine noise falls on all three alike, and their middle ranges must
//! overlap (and their medians sit within a fraction of a millisecond of each other).

use crate::common::*;
use serde_json::json;
use std::time::{Duration, Instant};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn refusals_take_the_same_time_whichever_check_failed() {
    let a = Appliance::start();
    let pool = a.pool("p1");
    let (_, good) = a.token(&pool, json!({}));
    let (t2, other) = a.token(&pool, json!({}));
    let (t3, expired) = a.token(&pool, json!({}));
    a.db()
        .execute(
            "UPDATE join_tokens SET expires_at = 1000 WHERE id = ?1",
            [t3["id"].as_str().unwrap()],
        )
        .unwrap();
    let _ = t2;
    let (id, secret) = good.trim_start_matches("bcjt_").split_once('.').unwrap();
    let (_, other_secret) = other.trim_start_matches("bcjt_").split_once('.').unwrap();
    // An id that is well formed and in no row: the last character changed within the alphabet.
    let mut unknown_id = id.to_string();
    let last = unknown_id.pop().unwrap();
    unknown_id.push(if last == '0' { '1' } else { '0' });
    let cases = [
        ("unknown id", format!("bcjt_{unknown_id}.{secret}")),
        ("wrong secret", format!("bcjt_{id}.{other_secret}")),
        ("expired", expired.clone()),
    ];
    let sim = Sim::new(&a);
    // Warm up (connections, caches).
    for (_, t) in &cases {
        let (raw, _, _) = sim.join(t, &machine());
        assert_eq!(raw, refused_bytes());
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); cases.len()];
    for _ in 0..60 {
        for (i, (_, t)) in cases.iter().enumerate() {
            let claims = machine();
            let start = Instant::now();
            let (raw, _, _) = sim.join(t, &claims);
            times[i].push(start.elapsed());
            // Every refusal is the same bytes.
            assert_eq!(raw, refused_bytes());
        }
    }
    let ranges: Vec<(Duration, Duration, Duration)> = times
        .iter_mut()
        .map(|v| (pct(v, 0.25), pct(v, 0.5), pct(v, 0.75)))
        .collect();
    for (i, (name, _)) in cases.iter().enumerate() {
        eprintln!(
            "{name}: p25 {:?} p50 {:?} p75 {:?}",
            ranges[i].0, ranges[i].1, ranges[i].2
        );
    }
    // Every pair's interquartile ranges overlap.
    for i in 0..ranges.len() {
        for j in i + 1..ranges.len() {
            let (lo_i, _, hi_i) = ranges[i];
            let (lo_j, _, hi_j) = ranges[j];
            assert!(
                lo_i <= hi_j && lo_j <= hi_i,
                "{} and {} do not overlap: {:?} vs {:?}",
                cases[i].0,
                cases[j].0,
                ranges[i],
                ranges[j]
            );
        }
    }
    // Nothing was consumed: the good token still has its use.
    assert_eq!(a.uses_left(good_id(&good)), 1);
}

fn good_id(token: &str) -> &str {
    token.trim_start_matches("bcjt_").split_once('.').unwrap().0
}
