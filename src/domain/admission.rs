//! The seed's admission rules, as pure functions of the rows involved, the claims and `now`: the
//! join-token attestor's checks and the admission after it (`expect`, placeholders, reclaim,
//! pool, tenant, site, hosted trust), the `discovery` attestor's reclaim predicates ([`HeldBy`]),
//! the `tpm` attestor's pool choice and reclaim rule, and every refusal [`Reason`]. The
//! JoinService loads the rows inside its transaction, asks these functions, and writes what they
//! decide through `join::admit`.

use crate::base::crypto;
use crate::domain::pool::Pool;
use crate::domain::token::expect_matches;
use crate::domain::token::TokenRow;
use crate::proto::claims::{HardwareKey, Identifiers};

/// Why a join was refused: recorded as `security.join.refused`'s `reason`, never told the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Malformed,
    Unknown,
    SecretMismatch,
    Revoked,
    Expired,
    Exhausted,
    RoleMismatch,
    /// The seal could not be opened, or was made for another CSR.
    Token,
    /// The CSR is not a valid P-256 request signed by its own key.
    Csr,
    /// The claims are not a machine's (too large).
    Claims,
    /// An attestor this appliance does not run.
    Attestor,
    Expect,
    PlaceholderHardware,
    Reclaim,
    Pool,
    Tenant,
    Site,
    PoolAttestor,
    /// A `provisioned` token presented for another node than its own (`--node-id`), or by a
    /// machine that is not that node.
    ProvisionedNode,
    DiscoveryUnknown,
    DiscoverySecretMismatch,
    /// The discovery token was spent, or voided by a newer boot of the same MAC.
    DiscoverySpent,
    DiscoveryExpired,
    DiscoveryRoleMismatch,
    /// The claims do not carry the MAC the discovery token is bound to.
    DiscoveryMac,
    /// An operator rejected this machine's request for this CSR.
    DiscoveryRejected,
    /// The machine's open request was made by a boot with another MAC.
    DiscoveryMacConflict,
    /// The token stands for another machine's request.
    DiscoveryTokenReused,
    /// The machine's open request was made from another address.
    DiscoveryAddressConflict,
    /// The `tpm` evidence is not well-formed: public areas, the CSR, base64.
    TpmMalformed,
    /// The AK is not one bca accepts (fixedTPM, fixedParent, restricted, sign, P-256).
    TpmAk,
    /// The challenge is unknown, used, expired, or for another EK or AK, or the credential's
    /// secret is not the one it carried.
    TpmChallenge,
    /// The AK's certification of the node key fails, or certifies another key than the CSR's.
    TpmCertify,
    /// The EK is on no allow-list and enrollment is off.
    TpmEkUnknown,
    /// An operator rejected this TPM's request for this CSR.
    TpmRejected,
    /// A role other than `node` or `ramdisk`.
    TpmRoleMismatch,
    /// Too many unknown EKs wait for an operator (in all, or from this source).
    TpmEnrollmentLimit,
    /// `[x509pop] enabled` is off.
    X509PopDisabled,
    /// The evidence is not well-formed: base64, the challenge's length, a node certificate.
    X509PopMalformed,
    /// The certificate is not byte for byte a `node_certs` row of a node that exists.
    X509PopUnknown,
    /// The node holds a newer certificate than the one presented.
    X509PopNotNewest,
    /// The certificate has not expired, or the node holds an unexpired one: renew instead.
    X509PopNotExpired,
    /// The certificate expired longer ago than `[x509pop] max_expired_seconds`.
    X509PopExpiredTooLong,
    X509PopRevoked,
    /// The certificate is of an earlier identity generation (the node was reclaimed since).
    X509PopGeneration,
    /// The signature is not the certificate's key's, over this challenge, CSR and node.
    X509PopPop,
    /// The challenge is unknown, spent or expired, or not the one signed.
    X509PopChallenge,
    X509PopRetired,
    /// The certificate names a TPM AK and the new key is not proven to be that TPM's.
    X509PopKeyAttestation,
}

impl Reason {
    /// The attestor a reason belongs to (`join:` reasons belong to the join itself).
    pub fn attestor(self) -> &'static str {
        if self.as_str().starts_with("discovery:") {
            "discovery"
        } else if self.as_str().starts_with("tpm:") {
            "tpm"
        } else if self.as_str().starts_with("x509pop:") {
            "x509pop"
        } else {
            "join-token"
        }
    }

    /// `<attestor>:<reason>` as the seed writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Malformed => "join-token:malformed",
            Reason::Unknown => "join-token:unknown",
            Reason::SecretMismatch => "join-token:secret-mismatch",
            Reason::Revoked => "join-token:revoked",
            Reason::Expired => "join-token:expired",
            Reason::Exhausted => "join-token:exhausted",
            Reason::RoleMismatch => "join-token:role-mismatch",
            Reason::Token => "join:token",
            Reason::Csr => "join:csr",
            Reason::Claims => "join:claims",
            Reason::Attestor => "join:attestor",
            Reason::Expect => "join:expect",
            Reason::PlaceholderHardware => "join:placeholder-hardware",
            Reason::Reclaim => "join:reclaim",
            Reason::Pool => "join:pool",
            Reason::Tenant => "join:tenant",
            Reason::Site => "join:site",
            Reason::PoolAttestor => "join:pool-attestor",
            Reason::ProvisionedNode => "join:provisioned-node",
            Reason::DiscoveryUnknown => "discovery:unknown",
            Reason::DiscoverySecretMismatch => "discovery:secret-mismatch",
            Reason::DiscoverySpent => "discovery:spent",
            Reason::DiscoveryExpired => "discovery:expired",
            Reason::DiscoveryRoleMismatch => "discovery:role-mismatch",
            Reason::DiscoveryMac => "discovery:mac",
            Reason::DiscoveryRejected => "discovery:rejected",
            Reason::DiscoveryMacConflict => "discovery:mac-conflict",
            Reason::DiscoveryTokenReused => "discovery:token-reused",
            Reason::DiscoveryAddressConflict => "discovery:address-conflict",
            Reason::TpmMalformed => "tpm:malformed",
            Reason::TpmAk => "tpm:ak",
            Reason::TpmChallenge => "tpm:challenge",
            Reason::TpmCertify => "tpm:certify",
            Reason::TpmEkUnknown => "tpm:ek-unknown",
            Reason::TpmRejected => "tpm:rejected",
            Reason::TpmRoleMismatch => "tpm:role-mismatch",
            Reason::TpmEnrollmentLimit => "tpm:enrollment-limit",
            Reason::X509PopDisabled => "x509pop:disabled",
            Reason::X509PopMalformed => "x509pop:malformed",
            Reason::X509PopUnknown => "x509pop:unknown",
            Reason::X509PopNotNewest => "x509pop:not-newest",
            Reason::X509PopNotExpired => "x509pop:not-expired",
            Reason::X509PopExpiredTooLong => "x509pop:expired-too-long",
            Reason::X509PopRevoked => "x509pop:revoked",
            Reason::X509PopGeneration => "x509pop:generation",
            Reason::X509PopPop => "x509pop:pop",
            Reason::X509PopChallenge => "x509pop:challenge",
            Reason::X509PopRetired => "x509pop:retired",
            Reason::X509PopKeyAttestation => "x509pop:key-attestation",
        }
    }
}

/// What the store knows of the certificate an `x509pop` re-join presents (matched byte for byte
/// to its `node_certs` row) and of its node.
pub struct X509PopCert {
    pub retired: bool,
    pub generation: i64,
    pub current_generation: i64,
    pub revoked: bool,
    pub not_after: i64,
    /// The certificate is the node's last issued.
    pub newest: bool,
    /// The node holds a certificate that is neither revoked nor expired.
    pub node_has_live: bool,
    /// The certificate is the node's last but one, and the last is live, of the current
    /// generation, and certifies the new CSR's key: an `x509pop` re-join whose answer was lost
    /// (the machine retries with the same new key).
    pub lost_answer: bool,
}

/// What an `x509pop` re-join gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum X509PopVerdict {
    /// A new certificate.
    Issue,
    /// The certificate already issued for this new key, again (its answer was lost).
    AnswerAgain,
}

/// The seed's `x509pop` rules for a certificate whose key the machine proved: the node not
/// retired; the certificate of its current identity generation, unrevoked, its newest, expired,
/// and not longer than `max_expired` ago; the node holding no live certificate, so a copy of an
/// old key can never split off a second copy of a live node.
///
/// One exception keeps a lost answer from stranding the node: the same machine retrying with the
/// same new key (it proves the old key again, over a new challenge) gets the certificate already
/// issued for that key, answered again; nothing new is issued.
pub fn x509pop_check(
    c: &X509PopCert,
    now: i64,
    max_expired: i64,
) -> Result<X509PopVerdict, Reason> {
    if c.retired {
        return Err(Reason::X509PopRetired);
    }
    if c.generation != c.current_generation {
        return Err(Reason::X509PopGeneration);
    }
    if c.revoked {
        return Err(Reason::X509PopRevoked);
    }
    let within = c.not_after <= now && now - c.not_after <= max_expired;
    if !c.newest {
        return if c.lost_answer && within {
            Ok(X509PopVerdict::AnswerAgain)
        } else {
            Err(Reason::X509PopNotNewest)
        };
    }
    if c.not_after > now || c.node_has_live {
        return Err(Reason::X509PopNotExpired);
    }
    if !within {
        return Err(Reason::X509PopExpiredTooLong);
    }
    Ok(X509PopVerdict::Issue)
}

/// Roles an agent may ask a join token for, and the token role that admits each.
pub fn token_role_admits(token_role: &str, requested: &str) -> bool {
    token_role == requested || (token_role == "provisioned" && requested == "node")
}

/// The join-token attestor's checks, in the seed's order, once the row is locked: the secret (in
/// constant time), revocation, expiry at `now`, remaining uses and role. `Ok` means one use may
/// be consumed.
pub fn check_token(
    t: &TokenRow,
    secret: &[u8; 32],
    requested_role: &str,
    now: i64,
) -> Result<(), Reason> {
    if !crypto::ct_eq(&crypto::sha256(secret), &t.secret_sha256) {
        return Err(Reason::SecretMismatch);
    }
    if t.revoked_at.is_some() {
        return Err(Reason::Revoked);
    }
    if now >= t.expires_at {
        return Err(Reason::Expired);
    }
    if t.uses_left <= 0 {
        return Err(Reason::Exhausted);
    }
    if !token_role_admits(&t.role, requested_role) {
        return Err(Reason::RoleMismatch);
    }
    Ok(())
}

/// A node that already holds the machine's trusted hardware key.
#[derive(Debug, Clone)]
pub struct KnownNode {
    pub id: String,
    pub tenant_id: String,
    pub site_id: String,
    pub pool_id: String,
    pub role: String,
    pub state: String,
    pub trust: String,
    pub identity_generation: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    New,
    Reclaim { node_id: String, generation: i64 },
}

/// What admission decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub kind: Kind,
    /// The certificate's role: `node`, or `node-tenant` for a tenant-controlled hosted node.
    pub role: String,
    /// `platform`, `tenant-owned` or `tenant-controlled`.
    pub trust: String,
    /// The node's hardware key counts as the machine's: trusted, over a product UUID or a
    /// serial. A machine admitted only by its token's `expect` binding (placeholder hardware)
    /// joins with an untrusted key: never a reclaim, and never reclaimed by a later join.
    pub key_trusted: bool,
}

pub struct AdmitInput<'a> {
    pub token: &'a TokenRow,
    pub pool: Option<&'a Pool>,
    pub site_id: &'a str,
    pub root_tenant: &'a str,
    pub ids: &'a Identifiers,
    pub key: Option<&'a HardwareKey>,
    pub known: Option<&'a KnownNode>,
    /// The node the agent says it is (`--node-id`): a `provisioned` token's must be its own.
    pub node_id: Option<&'a str>,
}

/// The trust of a node its pool's tenant owns: `platform` in the root tenant's pools (the site's
/// owner), else `tenant-owned`.
pub fn owned_trust<'a>(pool_tenant: &str, root_tenant: &str) -> &'a str {
    if pool_tenant == root_tenant {
        "platform"
    } else {
        "tenant-owned"
    }
}

/// `expect`, the placeholder rule, the reclaim rules, then the pool's own checks.
pub fn admit(i: &AdmitInput<'_>) -> Result<Admission, Reason> {
    let t = i.token;
    if let Some(e) = &t.expect {
        if !expect_matches(e, i.ids) {
            return Err(Reason::Expect);
        }
    }
    let trusted = key_counts(i.key, i.ids);
    if !trusted && t.expect.is_none() {
        return Err(Reason::PlaceholderHardware);
    }
    let pool = i.pool.ok_or(Reason::Pool)?;
    if pool.agent != "bcd" || pool.archived_at.is_some() {
        return Err(Reason::Pool);
    }
    if pool.tenant_id != t.tenant_id {
        return Err(Reason::Tenant);
    }
    if pool.site_id != t.site_id || t.site_id != i.site_id {
        return Err(Reason::Site);
    }
    if !pool.allows_attestor("join-token") {
        return Err(Reason::PoolAttestor);
    }
    if t.role == "provisioned" {
        return provisioned(t, i, trusted);
    }
    // Hosted tokens lower trust unless the platform operates the pool: the platform owns it (its
    // tenant is the site's owner, the root tenant) and its policy says so.
    let platform_operated = pool.tenant_id == i.root_tenant
        && pool
            .policy
            .kubernetes
            .as_ref()
            .is_some_and(|k| k.platform_operated);
    let tenant_controlled = t.hosted.as_deref() == Some("kubernetes") && !platform_operated;
    let (role, mut trust) = if tenant_controlled {
        ("node-tenant".to_string(), "tenant-controlled".to_string())
    } else {
        (
            "node".to_string(),
            owned_trust(&pool.tenant_id, i.root_tenant).to_string(),
        )
    };
    let mut role = role;
    let kind = match (trusted, i.known) {
        (true, Some(n)) => {
            let same =
                n.tenant_id == t.tenant_id && n.site_id == t.site_id && n.pool_id == t.pool_id;
            // An OS node again, hosted or not: `node` and `node-tenant` are one machine's roles
            // (a `ramdisk` becomes an OS node only through a `provisioned` token).
            let os_node = |r: &str| r == "node" || r == "node-tenant";
            if !t.allow_reclaim || !same || !os_node(&n.role) || n.state == "retired" {
                return Err(Reason::Reclaim);
            }
            // A hosted reclaim lowers a node to `tenant-controlled` (a `node-tenant`
            // certificate); a reclaim never raises a tenant-controlled node back.
            if tenant_controlled || n.trust == "tenant-controlled" {
                trust = "tenant-controlled".into();
                role = "node-tenant".into();
            }
            Kind::Reclaim {
                node_id: n.id.clone(),
                generation: n.identity_generation + 1,
            }
        }
        _ => Kind::New,
    };
    Ok(Admission {
        kind,
        role,
        trust,
        key_trusted: trusted,
    })
}

/// A `provisioned` token (`nodes.provisionToken`): the operating system a deploy installed on a
/// node the discovery ramdisk brought in joins as that node, role `node`: the same node id, the
/// next identity generation, its trust kept, no `allowReclaim` needed. Only for that node: the
/// `--node-id` the agent gives, and the node the machine's trusted hardware key names, must both
/// be the token's.
fn provisioned(t: &TokenRow, i: &AdmitInput<'_>, trusted: bool) -> Result<Admission, Reason> {
    let want = t.node_id.as_deref().ok_or(Reason::ProvisionedNode)?;
    if i.node_id != Some(want) {
        return Err(Reason::ProvisionedNode);
    }
    let n = i
        .known
        .filter(|n| trusted && n.id == want && n.state != "retired")
        .ok_or(Reason::ProvisionedNode)?;
    Ok(Admission {
        kind: Kind::Reclaim {
            node_id: n.id.clone(),
            generation: n.identity_generation + 1,
        },
        role: "node".into(),
        trust: n.trust.clone(),
        key_trusted: true,
    })
}

/// Whether a `join-token` join's hardware key stands for the machine: trusted (two identifiers
/// or more) and over a product UUID or a serial. A key of MACs alone (placeholder UUID and
/// serials) does not: a NIC moves between machines.
pub fn key_counts(key: Option<&HardwareKey>, ids: &Identifiers) -> bool {
    key.is_some_and(|k| k.trusted) && ids.has_primary()
}

/// A live node that holds a discovery join's trusted hardware key, as the `discovery` attestor
/// weighs it.
#[derive(Debug, Clone)]
pub struct HeldBy {
    pub id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub role: String,
    pub generation: i64,
    pub boot_mac: Option<String>,
    /// The MACs of the node's recorded claims (normalised).
    pub claim_macs: Vec<String>,
    /// Who recorded its identifiers: `discovery`, `tpm`, `approval` or `token`.
    pub identifiers_by: String,
    pub connected: bool,
    pub rediscover: bool,
    pub pool_allows_discovery: bool,
}

impl HeldBy {
    /// A node whose machine may come back as itself through the discovery ramdisk: a `ramdisk`
    /// node, or one an operator marked for rediscovery.
    pub fn may_boot_ramdisk(&self) -> bool {
        self.role == "ramdisk" || self.rediscover
    }

    /// Whether a discovery join with a token for `token_mac` may be admitted as this node with
    /// no operator (`approval = "unknown-machines"`): what the network saw (a sighting of the
    /// node's own boot MAC), who vouched for its identifiers, its pool, its session, its role.
    pub fn reclaimable_unapproved(&self, token_mac: &str, sighted: bool) -> bool {
        let mac_is_its_own = match &self.boot_mac {
            Some(m) => m == token_mac,
            None => self.claim_macs.iter().any(|m| m == token_mac),
        };
        sighted
            && mac_is_its_own
            && matches!(
                self.identifiers_by.as_str(),
                "discovery" | "tpm" | "approval"
            )
            && self.pool_allows_discovery
            && !self.connected
            && self.may_boot_ramdisk()
    }

    /// Whether an operator's approval into `pool` admits the machine as this node.
    pub fn reclaimable_approved(&self, pool: &str) -> bool {
        self.pool_id == pool && self.may_boot_ramdisk()
    }
}

/// Which pool a `tpm` join lands in, and by what: the allow-list's entry for its EK first, then
/// the EK CA bundle's pool (when the EK certificate verified and no retired node blocks it), then
/// the pool of the node this EK already is. `None`: an operator decides (a join request).
pub fn tpm_pool(
    allowed: Option<String>,
    ca_pool: Option<String>,
    known_pool: Option<&str>,
) -> Option<(String, &'static str)> {
    match (allowed, ca_pool, known_pool) {
        (Some(pool), _, _) => Some((pool, "allow-list")),
        (None, Some(pool), _) => Some((pool, "ek-ca")),
        (None, None, Some(pool)) => Some((pool.to_string(), "known-ek")),
        (None, None, None) => None,
    }
}

/// Whether a `tpm` join may be the node its EK already is: the same tenant and pool, and the
/// same role, or a machine discovered as a ramdisk that now runs its OS.
pub fn tpm_reclaims(known: (&str, &str, &str), pool: (&str, &str), role: &str) -> bool {
    let (tenant, pool_id, known_role) = known;
    tenant == pool.0 && pool_id == pool.1 && (known_role == role || known_role == "ramdisk")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::pool::KubernetesPolicy;
    use crate::domain::pool::Policy;
    use crate::domain::token::Expect;
    use crate::proto::claims::{hardware_key, Claims};

    fn token() -> TokenRow {
        TokenRow {
            id: "jt_x".into(),
            tenant_id: "tn_root".into(),
            pool_id: "pool_a".into(),
            site_id: "site_1".into(),
            role: "node".into(),
            secret_sha256: crypto::sha256(&[7u8; 32]).to_vec(),
            max_uses: 2,
            uses_left: 2,
            expect: None,
            allow_reclaim: false,
            hosted: None,
            created_at: 0,
            expires_at: 100,
            revoked_at: None,
            node_id: None,
        }
    }

    fn pool() -> Pool {
        Pool {
            id: "pool_a".into(),
            tenant_id: "tn_root".into(),
            site_id: "site_1".into(),
            name: "a".into(),
            agent: "bcd".into(),
            policy: Policy::default(),
            archived_at: None,
            created_at: 0,
            updated_at: 0,
        }
    }

    fn good_ids() -> Identifiers {
        let c: Claims = serde_json::from_str(r#"{"productUuid":"4c4c4544-004d-3610-804a-b4c04f564433","serials":{"product":"SN-1"}}"#).unwrap();
        Identifiers::from_claims(&c)
    }

    fn run(
        t: &TokenRow,
        p: Option<&Pool>,
        ids: &Identifiers,
        known: Option<&KnownNode>,
    ) -> Result<Admission, Reason> {
        let key = hardware_key(ids);
        admit(&AdmitInput {
            token: t,
            pool: p,
            site_id: "site_1",
            root_tenant: "tn_root",
            ids,
            key: key.as_ref(),
            known,
            node_id: None,
        })
    }

    #[test]
    fn token_checks_in_order() {
        let t = token();
        assert_eq!(check_token(&t, &[7u8; 32], "node", 50), Ok(()));
        assert_eq!(
            check_token(&t, &[8u8; 32], "node", 50),
            Err(Reason::SecretMismatch)
        );
        assert_eq!(
            check_token(
                &TokenRow {
                    revoked_at: Some(1),
                    ..token()
                },
                &[7u8; 32],
                "node",
                50
            ),
            Err(Reason::Revoked)
        );
        assert_eq!(
            check_token(&t, &[7u8; 32], "node", 100),
            Err(Reason::Expired)
        );
        assert_eq!(
            check_token(
                &TokenRow {
                    uses_left: 0,
                    ..token()
                },
                &[7u8; 32],
                "node",
                50
            ),
            Err(Reason::Exhausted)
        );
        assert_eq!(
            check_token(&t, &[7u8; 32], "ramdisk", 50),
            Err(Reason::RoleMismatch)
        );
    }

    #[test]
    fn pool_tenant_site_and_attestor() {
        let t = token();
        let ids = good_ids();
        assert_eq!(run(&t, Some(&pool()), &ids, None).unwrap().kind, Kind::New);
        assert_eq!(run(&t, None, &ids, None), Err(Reason::Pool));
        assert_eq!(
            run(
                &t,
                Some(&Pool {
                    agent: "none".into(),
                    ..pool()
                }),
                &ids,
                None
            ),
            Err(Reason::Pool)
        );
        assert_eq!(
            run(
                &t,
                Some(&Pool {
                    archived_at: Some(1),
                    ..pool()
                }),
                &ids,
                None
            ),
            Err(Reason::Pool)
        );
        assert_eq!(
            run(
                &t,
                Some(&Pool {
                    tenant_id: "tn_other".into(),
                    ..pool()
                }),
                &ids,
                None
            ),
            Err(Reason::Tenant)
        );
        assert_eq!(
            run(
                &t,
                Some(&Pool {
                    site_id: "site_2".into(),
                    ..pool()
                }),
                &ids,
                None
            ),
            Err(Reason::Site)
        );
        let t2 = TokenRow {
            site_id: "site_2".into(),
            ..token()
        };
        assert_eq!(
            run(
                &t2,
                Some(&Pool {
                    site_id: "site_2".into(),
                    ..pool()
                }),
                &ids,
                None
            ),
            Err(Reason::Site)
        );
        let only_tpm = Pool {
            policy: Policy {
                join_attestors: Some(vec!["tpm".into()]),
                ..Default::default()
            },
            ..pool()
        };
        assert_eq!(
            run(&t, Some(&only_tpm), &ids, None),
            Err(Reason::PoolAttestor)
        );
    }

    #[test]
    fn expect_and_placeholders() {
        let ids = good_ids();
        let bound = TokenRow {
            expect: Some(Expect {
                serial: Some("sn-1".into()),
                ..Default::default()
            }),
            ..token()
        };
        assert!(run(&bound, Some(&pool()), &ids, None).is_ok());
        let wrong = TokenRow {
            expect: Some(Expect {
                serial: Some("sn-2".into()),
                ..Default::default()
            }),
            ..token()
        };
        assert_eq!(run(&wrong, Some(&pool()), &ids, None), Err(Reason::Expect));
        let c: Claims = serde_json::from_str(
            r#"{"serials":{"product":"Default string"},"macs":["00:1b:21:3a:4f:5e"]}"#,
        )
        .unwrap();
        let weak = Identifiers::from_claims(&c);
        assert_eq!(
            run(&token(), Some(&pool()), &weak, None),
            Err(Reason::PlaceholderHardware)
        );
        let by_mac = TokenRow {
            expect: Some(Expect {
                mac: Some("00:1b:21:3a:4f:5e".into()),
                ..Default::default()
            }),
            ..token()
        };
        assert_eq!(
            run(&by_mac, Some(&pool()), &weak, None).unwrap().kind,
            Kind::New
        );
    }

    #[test]
    fn reclaims() {
        let ids = good_ids();
        let known = KnownNode {
            id: "node_1".into(),
            tenant_id: "tn_root".into(),
            site_id: "site_1".into(),
            pool_id: "pool_a".into(),
            role: "node".into(),
            state: "adopted".into(),
            trust: "platform".into(),
            identity_generation: 1,
        };
        assert_eq!(
            run(&token(), Some(&pool()), &ids, Some(&known)),
            Err(Reason::Reclaim)
        );
        let t = TokenRow {
            allow_reclaim: true,
            ..token()
        };
        assert_eq!(
            run(&t, Some(&pool()), &ids, Some(&known)).unwrap().kind,
            Kind::Reclaim {
                node_id: "node_1".into(),
                generation: 2
            }
        );
        let other_pool = KnownNode {
            pool_id: "pool_b".into(),
            ..known.clone()
        };
        assert_eq!(
            run(&t, Some(&pool()), &ids, Some(&other_pool)),
            Err(Reason::Reclaim)
        );
        let other_tenant = KnownNode {
            tenant_id: "tn_b".into(),
            ..known.clone()
        };
        assert_eq!(
            run(&t, Some(&pool()), &ids, Some(&other_tenant)),
            Err(Reason::Reclaim)
        );
        let retired = KnownNode {
            state: "retired".into(),
            ..known.clone()
        };
        assert_eq!(
            run(&t, Some(&pool()), &ids, Some(&retired)),
            Err(Reason::Reclaim)
        );
        // A ramdisk becomes an OS node only through a `provisioned` token.
        let ramdisk = KnownNode {
            role: "ramdisk".into(),
            ..known.clone()
        };
        assert_eq!(
            run(&t, Some(&pool()), &ids, Some(&ramdisk)),
            Err(Reason::Reclaim)
        );
        // A tenant-controlled node stays so: a plain token's reclaim never raises it.
        let tenant_controlled = KnownNode {
            role: "node-tenant".into(),
            trust: "tenant-controlled".into(),
            ..known.clone()
        };
        let a = run(&t, Some(&pool()), &ids, Some(&tenant_controlled)).unwrap();
        assert_eq!(
            (a.role.as_str(), a.trust.as_str()),
            ("node-tenant", "tenant-controlled")
        );
        // A hosted reclaim lowers a platform node to tenant-controlled, unless the platform
        // operates the pool.
        let hosted = TokenRow {
            hosted: Some("kubernetes".into()),
            ..t.clone()
        };
        let a = run(&hosted, Some(&pool()), &ids, Some(&known)).unwrap();
        assert!(matches!(a.kind, Kind::Reclaim { .. }));
        assert_eq!(
            (a.role.as_str(), a.trust.as_str()),
            ("node-tenant", "tenant-controlled")
        );
        let operated = Pool {
            policy: Policy {
                kubernetes: Some(KubernetesPolicy {
                    platform_operated: true,
                }),
                ..Default::default()
            },
            ..pool()
        };
        let a = run(&hosted, Some(&operated), &ids, Some(&known)).unwrap();
        assert_eq!((a.role.as_str(), a.trust.as_str()), ("node", "platform"));
    }

    #[test]
    fn hosted_tokens_lower_trust_unless_platform_operated() {
        let ids = good_ids();
        let t = TokenRow {
            hosted: Some("kubernetes".into()),
            ..token()
        };
        let a = run(&t, Some(&pool()), &ids, None).unwrap();
        assert_eq!(
            (a.role.as_str(), a.trust.as_str()),
            ("node-tenant", "tenant-controlled")
        );
        let operated = Pool {
            policy: Policy {
                kubernetes: Some(KubernetesPolicy {
                    platform_operated: true,
                }),
                ..Default::default()
            },
            ..pool()
        };
        let a = run(&t, Some(&operated), &ids, None).unwrap();
        assert_eq!((a.role.as_str(), a.trust.as_str()), ("node", "platform"));
        // A tenant cannot vouch for its own cluster by editing its pool's policy.
        let tenant_pool = Pool {
            tenant_id: "tn_t".into(),
            ..operated
        };
        let tt = TokenRow {
            tenant_id: "tn_t".into(),
            ..t
        };
        let a = run(&tt, Some(&tenant_pool), &ids, None).unwrap();
        assert_eq!(
            (a.role.as_str(), a.trust.as_str()),
            ("node-tenant", "tenant-controlled")
        );
    }

    fn held() -> HeldBy {
        HeldBy {
            id: "node_a".into(),
            tenant_id: "tn_root".into(),
            pool_id: "pool_a".into(),
            role: "ramdisk".into(),
            generation: 1,
            boot_mac: Some("52:54:00:00:00:01".into()),
            claim_macs: vec!["52:54:00:00:00:02".into()],
            identifiers_by: "discovery".into(),
            connected: false,
            rediscover: false,
            pool_allows_discovery: true,
        }
    }

    #[test]
    fn a_discovery_reclaim_without_an_operator_needs_what_the_network_saw_and_more() {
        let h = held();
        assert!(h.reclaimable_unapproved("52:54:00:00:00:01", true));
        // Not sighted, or another MAC than its boot MAC (its claims' MACs count only without one).
        assert!(!h.reclaimable_unapproved("52:54:00:00:00:01", false));
        assert!(!h.reclaimable_unapproved("52:54:00:00:00:02", true));
        let no_boot_mac = HeldBy {
            boot_mac: None,
            ..held()
        };
        assert!(no_boot_mac.reclaimable_unapproved("52:54:00:00:00:02", true));
        // Identifiers a token join recorded, a pool without discovery, a live session, a node
        // that runs its OS: an operator decides.
        for h in [
            HeldBy {
                identifiers_by: "token".into(),
                ..held()
            },
            HeldBy {
                pool_allows_discovery: false,
                ..held()
            },
            HeldBy {
                connected: true,
                ..held()
            },
            HeldBy {
                role: "node".into(),
                ..held()
            },
        ] {
            assert!(!h.reclaimable_unapproved("52:54:00:00:00:01", true));
        }
        // Marked for rediscovery, a node that runs its OS may come back through the ramdisk.
        let marked = HeldBy {
            role: "node".into(),
            rediscover: true,
            ..held()
        };
        assert!(marked.reclaimable_unapproved("52:54:00:00:00:01", true));
        // An approval admits it as this node only into its own pool.
        assert!(held().reclaimable_approved("pool_a"));
        assert!(!held().reclaimable_approved("pool_b"));
    }

    #[test]
    fn a_tpm_join_finds_its_pool_allow_list_first() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(
            tpm_pool(s("pool_l"), s("pool_c"), Some("pool_k")),
            Some(("pool_l".into(), "allow-list"))
        );
        assert_eq!(
            tpm_pool(None, s("pool_c"), Some("pool_k")),
            Some(("pool_c".into(), "ek-ca"))
        );
        assert_eq!(
            tpm_pool(None, None, Some("pool_k")),
            Some(("pool_k".into(), "known-ek"))
        );
        assert_eq!(tpm_pool(None, None, None), None);
        let known = ("tn_a", "pool_a", "ramdisk");
        assert!(tpm_reclaims(known, ("tn_a", "pool_a"), "node"));
        assert!(!tpm_reclaims(known, ("tn_b", "pool_a"), "node"));
        assert!(!tpm_reclaims(known, ("tn_a", "pool_b"), "node"));
        assert!(!tpm_reclaims(
            ("tn_a", "pool_a", "node"),
            ("tn_a", "pool_a"),
            "ramdisk"
        ));
        assert!(tpm_reclaims(
            ("tn_a", "pool_a", "node"),
            ("tn_a", "pool_a"),
            "node"
        ));
        assert_eq!(owned_trust("tn_root", "tn_root"), "platform");
        assert_eq!(owned_trust("tn_a", "tn_root"), "tenant-owned");
    }

    #[test]
    fn x509pop_admits_only_the_newest_expired_certificate_of_a_live_identity() {
        let now = 1_000_000;
        let ok = X509PopCert {
            retired: false,
            generation: 2,
            current_generation: 2,
            revoked: false,
            not_after: now - 100,
            newest: true,
            node_has_live: false,
            lost_answer: false,
        };
        let issue = Ok(X509PopVerdict::Issue);
        assert_eq!(x509pop_check(&ok, now, 604_800), issue);
        let with = |f: &dyn Fn(&mut X509PopCert)| {
            let mut c = X509PopCert { ..ok };
            f(&mut c);
            x509pop_check(&c, now, 604_800)
        };
        assert_eq!(with(&|c| c.retired = true), Err(Reason::X509PopRetired));
        assert_eq!(with(&|c| c.generation = 1), Err(Reason::X509PopGeneration));
        assert_eq!(with(&|c| c.revoked = true), Err(Reason::X509PopRevoked));
        assert_eq!(with(&|c| c.newest = false), Err(Reason::X509PopNotNewest));
        assert_eq!(
            with(&|c| c.not_after = now + 1),
            Err(Reason::X509PopNotExpired)
        );
        assert_eq!(
            with(&|c| c.node_has_live = true),
            Err(Reason::X509PopNotExpired)
        );
        // Expiring at `now` is expired; 7 days and one second ago is too long.
        assert_eq!(with(&|c| c.not_after = now), issue);
        assert_eq!(with(&|c| c.not_after = now - 604_800), issue);
        // A lost answer: answered again, only for the last-but-one certificate, within the window.
        let lost = |f: &dyn Fn(&mut X509PopCert)| {
            with(&|c| {
                c.newest = false;
                c.node_has_live = true;
                c.lost_answer = true;
                f(c)
            })
        };
        assert_eq!(lost(&|_| {}), Ok(X509PopVerdict::AnswerAgain));
        assert_eq!(
            lost(&|c| c.lost_answer = false),
            Err(Reason::X509PopNotNewest)
        );
        assert_eq!(
            lost(&|c| c.not_after = now - 604_801),
            Err(Reason::X509PopNotNewest)
        );
        assert_eq!(lost(&|c| c.revoked = true), Err(Reason::X509PopRevoked));
        assert_eq!(
            with(&|c| c.not_after = now - 604_801),
            Err(Reason::X509PopExpiredTooLong)
        );
        assert_eq!(Reason::X509PopChallenge.attestor(), "x509pop");
        assert_eq!(Reason::X509PopNotNewest.as_str(), "x509pop:not-newest");
    }

    #[test]
    fn a_provisioned_token_brings_back_only_its_node_as_an_os_node() {
        let ids = good_ids();
        let key = hardware_key(&ids);
        let t = TokenRow {
            role: "provisioned".into(),
            max_uses: 1,
            uses_left: 1,
            node_id: Some("node_r".into()),
            ..token()
        };
        let ramdisk = KnownNode {
            id: "node_r".into(),
            tenant_id: "tn_root".into(),
            site_id: "site_1".into(),
            pool_id: "pool_a".into(),
            role: "ramdisk".into(),
            state: "adopted".into(),
            trust: "platform".into(),
            identity_generation: 3,
        };
        let p = pool();
        let go = |node_id: Option<&str>, known: Option<&KnownNode>| {
            admit(&AdmitInput {
                token: &t,
                pool: Some(&p),
                site_id: "site_1",
                root_tenant: "tn_root",
                ids: &ids,
                key: key.as_ref(),
                known,
                node_id,
            })
        };
        let a = go(Some("node_r"), Some(&ramdisk)).unwrap();
        assert_eq!(
            a.kind,
            Kind::Reclaim {
                node_id: "node_r".into(),
                generation: 4
            }
        );
        assert_eq!((a.role.as_str(), a.trust.as_str()), ("node", "platform"));
        // Another --node-id, none, another machine, no machine, a retired node: refused.
        assert_eq!(
            go(Some("node_x"), Some(&ramdisk)),
            Err(Reason::ProvisionedNode)
        );
        assert_eq!(go(None, Some(&ramdisk)), Err(Reason::ProvisionedNode));
        let other = KnownNode {
            id: "node_o".into(),
            ..ramdisk.clone()
        };
        assert_eq!(
            go(Some("node_r"), Some(&other)),
            Err(Reason::ProvisionedNode)
        );
        assert_eq!(go(Some("node_r"), None), Err(Reason::ProvisionedNode));
        let retired = KnownNode {
            state: "retired".into(),
            ..ramdisk.clone()
        };
        assert_eq!(
            go(Some("node_r"), Some(&retired)),
            Err(Reason::ProvisionedNode)
        );
        // The token admits role `node` only.
        assert!(token_role_admits("provisioned", "node"));
        assert!(!token_role_admits("provisioned", "ramdisk"));
        assert!(!token_role_admits("node", "provisioned"));
    }
}
