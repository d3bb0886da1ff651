-- PostgreSQL's form of ../0005_tpm_attestor.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- The `tpm` attestor: the credential-activation challenges it hands out (single-use: deleted
-- when spent; the secret's hash only; a few per source, the oldest evicted), the EK that admitted
-- a node (a known EK reclaims its node), and whether a TPM join request's EK certificate was
-- issued by the EK CA bundle.
CREATE TABLE tpm_challenges (
    id             TEXT PRIMARY KEY,
    source         TEXT NOT NULL,                -- the caller's IPv4 address or IPv6 /64
    ek_sha256      TEXT NOT NULL,
    ak_name        TEXT NOT NULL,
    secret_sha256  BYTEA NOT NULL,
    ek_certified   BIGINT NOT NULL DEFAULT 0,   -- the EK certificate chains to the EK CA bundle
    created_at     BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    rowid                BIGSERIAL          -- the order rows were written in (SQLite's rowid)
);
CREATE INDEX tpm_challenges_expiry ON tpm_challenges (expires_at);
CREATE INDEX tpm_challenges_source ON tpm_challenges (source, created_at);

ALTER TABLE nodes ADD COLUMN tpm_ek_sha256 TEXT;
CREATE INDEX nodes_tpm_ek ON nodes (tpm_ek_sha256) WHERE tpm_ek_sha256 IS NOT NULL;

ALTER TABLE join_requests ADD COLUMN ek_certified BIGINT;
