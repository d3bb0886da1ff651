-- PostgreSQL's form of ../0004_tpm_eks.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- The TPM endorsement keys allowed to join by the `tpm` attestor, by the SHA-256 of the EK's DER
-- SubjectPublicKeyInfo (`bca tpm status` shows it as publicKeySha256), each into one pool.
CREATE TABLE tpm_eks (
    ek_sha256   TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL,
    pool_id     TEXT NOT NULL,
    note        TEXT,
    created_at  BIGINT NOT NULL,
    created_by  TEXT NOT NULL
);
CREATE INDEX tpm_eks_pool ON tpm_eks (tenant_id, pool_id);
