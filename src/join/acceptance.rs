//! Acceptance, the appliance's side (the rule is `domain::acceptance`): after an admission a pool
//! without checks adopts the node at once (`join::admit::write`); with checks it stays
//! `adopting`, disconnected, until its `Hello` starts acceptance (`node.acceptance.started`, then `node.adopted`, or
//! `node.acceptance.failed` with an `AcceptanceFailed` condition). `nodes.adopt` runs the checks
//! again after a fix, and so does every later `Hello` while the node is still `adopting`.
//!
//! What the checks read comes from the appliance's own records (the session, the claims the node
//! joined with, its newest certificate's statements) and from the `Hello`'s evidence, which the
//! agent signs with its node key: the gateway relays it and cannot change it.

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::domain::acceptance::{check, Evidence, Failure, HelloFacts};
use crate::proto::claims::{Claims, Identifiers};
use crate::proto::protocol::{hello_message, HelloEvidence, HELLO_PURPOSE};
use crate::proto::x509::NodeLeaf;
use crate::store::Tx;
use serde_json::json;

/// The largest claims a `Hello` may report (as a join's claims are bounded).
const MAX_CLAIMS: usize = 16 * 1024;

/// At the `Hello` of an `adopting` node (its session just opened with `leaf`): the evidence
/// recorded when its signature verifies under the node's key, then acceptance.
pub(crate) fn on_hello(
    tx: &Tx<'_>,
    leaf: &NodeLeaf,
    evidence: Option<&HelloEvidence>,
    now: i64,
) -> ApiResult<()> {
    let Some(row) = crate::store::nodes::acceptance_row(tx, &leaf.node_id)? else {
        return Ok(());
    };
    if row.state != "adopting" {
        return Ok(());
    }
    // The facts are this Hello's: an earlier Hello's clock says nothing of the machine now.
    let f = evidence
        .and_then(|e| facts(e, leaf, &row.claims_json, now))
        .map(|f| serde_json::to_string(&f).expect("serializes"));
    crate::store::nodes::set_hello_facts(tx, &leaf.node_id, f.as_deref())?;
    run(tx, &leaf.node_id, now).map(|_| ())
}

/// The evidence's facts, or `None` when it is not signed by this node's key.
fn facts(e: &HelloEvidence, leaf: &NodeLeaf, joined: &str, now: i64) -> Option<HelloFacts> {
    let claims = crypto::b64_decode(&e.claims).filter(|c| c.len() <= MAX_CLAIMS)?;
    let sig = crypto::b64_decode(&e.sig)?;
    let msg = hello_message(&leaf.node_id, e.client_time, &crypto::sha256(&claims));
    if !crypto::verify(&leaf.public_point, HELLO_PURPOSE, &msg, &sig) {
        tracing::info!(node = %leaf.node_id, "hello: the evidence is not signed by the node key; ignored");
        return None;
    }
    let joined: Claims = serde_json::from_str(joined).unwrap_or_default();
    let claims_match = serde_json::from_slice::<Claims>(&claims)
        .ok()
        .filter(Claims::within_limits)
        .is_some_and(|c| Identifiers::from_claims(&c) == Identifiers::from_claims(&joined));
    Some(HelloFacts {
        skew: e.client_time - now,
        claims_match,
    })
}

/// Runs the node's pool's acceptance checks. `None`: the node is not `adopting` (or gone);
/// `Some(Ok)`: adopted; `Some(Err)`: the failed check, recorded as its condition and event.
pub(crate) fn run(tx: &Tx<'_>, node_id: &str, now: i64) -> ApiResult<Option<Result<(), Failure>>> {
    let Some(row) = crate::store::nodes::acceptance_row(tx, node_id)? else {
        return Ok(None);
    };
    if row.state != "adopting" {
        return Ok(None);
    }
    let pool = crate::store::tenancy::pool_by_id(tx, &row.pool_id)?;
    let Some(policy) = pool.as_ref().and_then(|p| p.policy.acceptance()) else {
        // The pool's checks were removed since: nothing to wait for.
        crate::store::nodes::set_conditions(tx, node_id, None)?;
        crate::join::issue::adopt(tx, &row.tenant, node_id, &row.pool_id, now)?;
        return Ok(Some(Ok(())));
    };
    crate::store::events::publish(
        tx,
        now,
        &row.tenant,
        "node.acceptance.started",
        json!({"nodeId": node_id, "poolId": row.pool_id, "checks": policy.effective()}),
    )?;
    let joined: Claims = serde_json::from_str(&row.claims_json).unwrap_or_default();
    let evidence = Evidence {
        session: row.connected,
        hello: row
            .hello_facts
            .as_deref()
            .and_then(|f| serde_json::from_str(f).ok()),
        permanent_macs: Identifiers::from_claims(&joined).macs.len(),
        tpm_key: row
            .newest_der
            .as_deref()
            .and_then(crate::proto::x509::parse_node_leaf)
            .is_some_and(|l| l.statements.iter().any(|s| s.starts_with("urn:bc:tpm-ak:"))),
    };
    match check(policy, &evidence) {
        Ok(()) => {
            crate::store::nodes::set_conditions(tx, node_id, None)?;
            crate::join::issue::adopt(tx, &row.tenant, node_id, &row.pool_id, now)?;
            Ok(Some(Ok(())))
        }
        Err(f) => {
            let condition = json!([{
                "type": "AcceptanceFailed",
                "reason": f.check,
                "message": f.message,
                "since": crate::base::clock::rfc3339(now),
            }]);
            crate::store::nodes::set_conditions(tx, node_id, Some(&condition))?;
            crate::store::events::publish(
                tx,
                now,
                &row.tenant,
                "node.acceptance.failed",
                json!({"nodeId": node_id, "poolId": row.pool_id, "reason": f.check, "message": f.message}),
            )?;
            Ok(Some(Err(f)))
        }
    }
}
