-- PostgreSQL's form of ../0011_appliances.sql.
-- Several appliances serving one site (docs/scale-out.md). An appliance that holds the site's
-- keys on its own disk (the one `bca init` made) is `origin`; one that joined with `bca join-site`
-- is `pending` until an operator approves it on an appliance of the site, then `approved` (its
-- copy of the site's keys wrapped to its own public key), or `removed`.
CREATE TABLE site_appliances (
    id                   TEXT PRIMARY KEY,
    state                TEXT NOT NULL CHECK (state IN ('origin', 'pending', 'approved', 'removed')),
    names_json           TEXT NOT NULL,       -- the gateway names its leaf carries
    gateway_url          TEXT,                -- what agents are told to dial for this box
    wrap_public          BYTEA,                -- its wrapping key's P-256 point (NULL for origin)
    gateway_public       BYTEA,                -- its gateway TLS key's P-256 point
    fingerprint          TEXT NOT NULL,
    wrapped_keys         TEXT,                -- the site's keys sealed to wrap_public (compact JWE)
    gateway_cert         BYTEA,                -- its leaf, signed by the site's serving CA
    public_pki_json      TEXT,                -- the site's public PKI files at approval
    created_at           BIGINT NOT NULL,
    approved_at          BIGINT,
    approved_by          TEXT,
    heartbeat_at         BIGINT,
    removed_at           BIGINT
);

-- A node's live session is held by one appliance: the one that stops, or is found dead, closes
-- its own sessions only.
ALTER TABLE nodes ADD COLUMN session_appliance TEXT;

-- The renewal replay window, shared by every appliance of the site: a proof's digest, kept
-- until its window ends.
CREATE TABLE renewal_proofs (
    digest      TEXT PRIMARY KEY,   -- hex SHA-256 of the proof
    expires_at  BIGINT NOT NULL
);

-- Which appliance wrote an audit row (NULL: written before there were several).
ALTER TABLE audit ADD COLUMN appliance_id TEXT;
CREATE INDEX renewal_proofs_expiry ON renewal_proofs (expires_at);
