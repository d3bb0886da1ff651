//! The appliances of a site (`site_appliances`) and what they share beyond the rows of the
//! JoinService: the renewal replay window (`renewal_proofs`). See docs/scale-out.md.

use crate::base::error::{ApiError, ApiResult};
use crate::store::Tx;
use crate::store::{params, OptionalExtension};
use serde_json::{json, Value};

/// This process's appliance, set once by `serve` (every audit row and every session it records
/// names it). `None` in a process that serves nothing (the CLI, the tests' own stores).
static THIS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Names the appliance this process serves as; once.
pub fn set_this(id: &str) {
    let _ = THIS.set(id.to_string());
}

pub fn this() -> Option<&'static str> {
    THIS.get().map(String::as_str)
}

/// One appliance as `site_appliances` holds it.
#[derive(Clone, Debug)]
pub struct Appliance {
    pub id: String,
    pub state: String,
    pub names: Vec<String>,
    pub gateway_url: Option<String>,
    pub wrap_public: Option<Vec<u8>>,
    pub gateway_public: Option<Vec<u8>>,
    pub fingerprint: String,
    pub wrapped_keys: Option<String>,
    pub gateway_cert: Option<Vec<u8>>,
    pub public_pki_json: Option<String>,
    pub created_at: i64,
    pub approved_at: Option<i64>,
    pub approved_by: Option<String>,
    pub heartbeat_at: Option<i64>,
}

const COLUMNS: &str = "id, state, names_json, gateway_url, wrap_public, gateway_public, fingerprint,
    wrapped_keys, gateway_cert, public_pki_json, created_at, approved_at, approved_by, heartbeat_at";

fn row(r: &crate::store::Row) -> crate::store::SqlResult<Appliance> {
    Ok(Appliance {
        id: r.get(0)?,
        state: r.get(1)?,
        names: serde_json::from_str(&r.get::<_, String>(2)?).unwrap_or_default(),
        gateway_url: r.get(3)?,
        wrap_public: r.get(4)?,
        gateway_public: r.get(5)?,
        fingerprint: r.get(6)?,
        wrapped_keys: r.get(7)?,
        gateway_cert: r.get(8)?,
        public_pki_json: r.get(9)?,
        created_at: r.get(10)?,
        approved_at: r.get(11)?,
        approved_by: r.get(12)?,
        heartbeat_at: r.get(13)?,
    })
}

impl Appliance {
    /// As `bca site appliances list` shows it (no key material: the wrapped copy is only said to
    /// be there).
    pub fn shown(&self, lease_seconds: i64, now: i64) -> Value {
        let alive = self
            .heartbeat_at
            .is_some_and(|h| now - h <= lease_seconds && self.state != "removed");
        json!({
            "id": self.id,
            "state": self.state,
            "names": self.names,
            "gatewayUrl": self.gateway_url,
            "fingerprint": self.fingerprint,
            "holdsKeys": self.state == "origin" || self.wrapped_keys.is_some(),
            "createdAt": crate::base::clock::rfc3339(self.created_at),
            "approvedAt": self.approved_at.map(crate::base::clock::rfc3339),
            "approvedBy": self.approved_by,
            "lastHeartbeat": self.heartbeat_at.map(crate::base::clock::rfc3339),
            "alive": alive,
        })
    }
}

pub fn get(tx: &Tx<'_>, id: &str) -> ApiResult<Option<Appliance>> {
    Ok(crate::store::query_row(
        tx,
        &format!("SELECT {COLUMNS} FROM site_appliances WHERE id = ?1"),
        [id],
        row,
    )
    .optional()?)
}

pub fn list(tx: &Tx<'_>) -> ApiResult<Vec<Appliance>> {
    Ok(crate::store::query_all(
        tx,
        &format!("SELECT {COLUMNS} FROM site_appliances ORDER BY created_at, id"),
        [],
        row,
    )?)
}

/// A new appliance's row: `pending` (joined with `bca join-site`) or `origin` (the one that holds
/// the site's keys on its own disk, recorded at its first `serve`). An `origin` row that exists
/// already is only refreshed (names, URL, heartbeat).
pub fn insert(tx: &Tx<'_>, a: &Appliance, now: i64) -> ApiResult<()> {
    let names = serde_json::to_string(&a.names).expect("serializes");
    if a.state == "origin" {
        crate::store::exec(
            tx,
            "INSERT INTO site_appliances (id, state, names_json, gateway_url, gateway_public,
                 fingerprint, created_at, heartbeat_at)
             VALUES (?1, 'origin', ?2, ?3, ?4, ?5, ?6, ?6)
             ON CONFLICT (id) DO UPDATE SET names_json = ?2, gateway_url = ?3, gateway_public = ?4,
                 fingerprint = ?5, heartbeat_at = ?6",
            params![
                a.id.as_str(),
                names.as_str(),
                a.gateway_url.as_deref(),
                a.gateway_public.as_deref(),
                a.fingerprint.as_str(),
                now
            ],
        )?;
        return Ok(());
    }
    crate::store::exec(
        tx,
        "INSERT INTO site_appliances (id, state, names_json, gateway_url, wrap_public,
             gateway_public, fingerprint, created_at)
         VALUES (?1, 'pending', ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            a.id.as_str(),
            names.as_str(),
            a.gateway_url.as_deref(),
            a.wrap_public.as_deref(),
            a.gateway_public.as_deref(),
            a.fingerprint.as_str(),
            now
        ],
    )?;
    Ok(())
}

/// Approves a `pending` appliance with its wrapped copy of the site's keys, its gateway leaf and
/// the site's public PKI. Exactly one row changes, or the appliance is not pending (an error
/// that says what it is).
pub fn approve(
    tx: &Tx<'_>,
    id: &str,
    (wrapped, cert, public_pki): (&str, &[u8], &str),
    by: &str,
    now: i64,
) -> ApiResult<()> {
    let n = crate::store::exec(
        tx,
        "UPDATE site_appliances SET state = 'approved', wrapped_keys = ?2, gateway_cert = ?3,
             public_pki_json = ?4, approved_at = ?5, approved_by = ?6
         WHERE id = ?1 AND state = 'pending'",
        params![id, wrapped, cert, public_pki, now, by],
    )?;
    if n != 1 {
        return Err(not_pending(tx, id)?);
    }
    Ok(())
}

fn not_pending(tx: &Tx<'_>, id: &str) -> ApiResult<ApiError> {
    Ok(match get(tx, id)? {
        None => ApiError::not_found(format!("no appliance {id} in this site")),
        Some(a) => ApiError::invalid_state(format!(
            "appliance {id} is {}, not pending: nothing was changed",
            a.state
        )),
    })
}

/// Removes an appliance from the site: its wrapped keys deleted, its state `removed`. An origin
/// appliance holds the keys on its own disk: it is not removed this way.
pub fn remove(tx: &Tx<'_>, id: &str, now: i64) -> ApiResult<Appliance> {
    let Some(a) = get(tx, id)? else {
        return Err(ApiError::not_found(format!(
            "no appliance {id} in this site"
        )));
    };
    match a.state.as_str() {
        "removed" => {
            return Err(ApiError::invalid_state(format!(
                "appliance {id} was removed already"
            )))
        }
        "origin" => {
            return Err(ApiError::invalid_state(format!(
                "appliance {id} is the site's origin (it holds the site's keys on its own disk): \
                 it cannot be removed from the site"
            )))
        }
        _ => {}
    }
    crate::store::exec(
        tx,
        "UPDATE site_appliances SET state = 'removed', wrapped_keys = NULL, removed_at = ?2
         WHERE id = ?1",
        params![id, now],
    )?;
    Ok(a)
}

/// An appliance's heartbeat (its lease on the sessions it holds): its state now, `None` when its
/// row is gone.
pub fn heartbeat(tx: &Tx<'_>, id: &str, now: i64) -> ApiResult<Option<String>> {
    crate::store::exec(
        tx,
        "UPDATE site_appliances SET heartbeat_at = ?2 WHERE id = ?1 AND state <> 'removed'",
        params![id, now],
    )?;
    Ok(crate::store::query_row(
        tx,
        "SELECT state FROM site_appliances WHERE id = ?1",
        [id],
        |r| r.get(0),
    )
    .optional()?)
}

/// The gateway URLs of the site's live appliances (origin and approved), for agents' failover.
pub fn gateway_urls(tx: &Tx<'_>) -> ApiResult<Vec<String>> {
    Ok(crate::store::query_all(
        tx,
        "SELECT gateway_url FROM site_appliances
         WHERE state IN ('origin', 'approved') AND gateway_url IS NOT NULL
         ORDER BY created_at, id",
        [],
        |r| r.get(0),
    )?)
}

/// Records a renewal proof's digest for the site's replay window; false when some appliance of
/// the site recorded it already (a replay). Digests whose window ended are forgotten first.
pub fn remember_proof(
    tx: &Tx<'_>,
    sha256: &[u8; 32],
    expires_at: i64,
    now: i64,
) -> ApiResult<bool> {
    crate::store::exec(
        tx,
        "DELETE FROM renewal_proofs WHERE expires_at < ?1",
        [now],
    )?;
    let n = crate::store::exec(
        tx,
        "INSERT INTO renewal_proofs (digest, expires_at) VALUES (?1, ?2)
         ON CONFLICT (digest) DO NOTHING",
        params![crate::base::crypto::hex(sha256), expires_at],
    )?;
    Ok(n == 1)
}
