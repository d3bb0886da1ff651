-- PostgreSQL's form of ../0003_discovery.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- PXE discovery: single-use, MAC-bound discovery tokens (hashes only), the join-request queue,
-- boot leases (who booted what, when) and the full-DHCP mode's address leases.
CREATE TABLE discovery_tokens (
    id                TEXT PRIMARY KEY,
    site_id           TEXT NOT NULL,
    mac               TEXT NOT NULL,
    secret_sha256     BYTEA NOT NULL,
    boot_lease_epoch  BIGINT,
    created_at        BIGINT NOT NULL,
    expires_at        BIGINT NOT NULL,
    spent_at          BIGINT,
    voided_at         BIGINT
);
CREATE INDEX discovery_tokens_mac ON discovery_tokens (mac);

CREATE TABLE join_requests (
    id                    TEXT PRIMARY KEY,
    site_id               TEXT NOT NULL,
    pool_id               TEXT REFERENCES pools(id),
    attestor              TEXT NOT NULL,
    machine_key           TEXT NOT NULL,   -- the trusted hardware key, else mac:<site>:<mac>
    hardware_key          TEXT,
    hardware_key_trusted  BIGINT NOT NULL DEFAULT 0,
    claims_json           TEXT NOT NULL,
    mac                   TEXT,
    ip                    TEXT,
    vouched_by            TEXT,
    boot_lease_epoch      BIGINT,
    csr_sha256            TEXT NOT NULL,
    state                 TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'rejected', 'expired', 'consumed')),
    created_at            BIGINT NOT NULL,
    updated_at            BIGINT NOT NULL,
    expires_at            BIGINT NOT NULL,
    decided_at            BIGINT,
    decided_by            TEXT,
    reason                TEXT,
    consumed_at           BIGINT,
    node_id               TEXT
);
-- A machine has at most one pending request.
CREATE UNIQUE INDEX join_requests_one_pending ON join_requests (machine_key) WHERE state = 'pending';

CREATE TABLE boot_leases (
    epoch       BIGSERIAL PRIMARY KEY,
    mac         TEXT NOT NULL,
    ip          TEXT,
    arch        BIGINT,
    stage       TEXT NOT NULL,
    file        TEXT,
    created_at  BIGINT NOT NULL
);
CREATE INDEX boot_leases_mac ON boot_leases (mac, epoch);

CREATE TABLE dhcp_leases (
    mac         TEXT PRIMARY KEY,
    ip          TEXT NOT NULL UNIQUE,
    expires_at  BIGINT NOT NULL
);

ALTER TABLE nodes ADD COLUMN rediscover BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN boot_mac TEXT;
