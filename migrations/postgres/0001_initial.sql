-- PostgreSQL's form of ../0001_initial.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- bca schema, version 1. Times are Unix seconds (UTC). Ids are `<prefix>_<26 base32>`.

CREATE TABLE site (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    trust_domain  TEXT NOT NULL,
    created_at    BIGINT NOT NULL
);

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    is_root     BIGINT NOT NULL DEFAULT 0,
    created_at  BIGINT NOT NULL
);

CREATE TABLE pools (
    id                      TEXT PRIMARY KEY,
    tenant_id               TEXT NOT NULL REFERENCES tenants(id),
    site_id                 TEXT NOT NULL REFERENCES site(id),
    name                    TEXT NOT NULL,
    agent                   TEXT NOT NULL CHECK (agent IN ('bcd', 'none')),
    join_attestors          TEXT,            -- JSON array, NULL = every attestor
    k8s_platform_operated   BIGINT NOT NULL DEFAULT 0,
    archived_at             BIGINT,
    created_at              BIGINT NOT NULL,
    updated_at              BIGINT NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE join_tokens (
    id               TEXT PRIMARY KEY,
    tenant_id        TEXT NOT NULL REFERENCES tenants(id),
    pool_id          TEXT NOT NULL REFERENCES pools(id),
    site_id          TEXT NOT NULL REFERENCES site(id),
    role             TEXT NOT NULL,
    secret_sha256    BYTEA NOT NULL,       -- only the hash of the secret is ever stored
    max_uses         BIGINT NOT NULL,
    uses_left        BIGINT NOT NULL CHECK (uses_left >= 0),
    expect_json      TEXT,
    allow_reclaim    BIGINT NOT NULL DEFAULT 0,
    hosted           TEXT,
    idempotency_key  TEXT NOT NULL,
    created_by       TEXT NOT NULL,
    created_at       BIGINT NOT NULL,
    expires_at       BIGINT NOT NULL,
    revoked_at       BIGINT
);
CREATE INDEX join_tokens_pool ON join_tokens (tenant_id, pool_id, id);

CREATE TABLE nodes (
    id                    TEXT PRIMARY KEY,
    tenant_id             TEXT NOT NULL REFERENCES tenants(id),
    site_id               TEXT NOT NULL REFERENCES site(id),
    pool_id               TEXT NOT NULL REFERENCES pools(id),
    role                  TEXT NOT NULL,
    state                 TEXT NOT NULL CHECK (state IN ('adopting', 'adopted', 'retired')),
    trust                 TEXT NOT NULL,
    hardware_key          TEXT,            -- hex SHA-256, NULL when no identifier survived
    hardware_key_trusted  BIGINT NOT NULL DEFAULT 0,
    identity_generation   BIGINT NOT NULL,
    attestor              TEXT NOT NULL,
    hostname              TEXT,
    claims_json           TEXT NOT NULL,
    created_at            BIGINT NOT NULL,
    updated_at            BIGINT NOT NULL,
    retired_at            BIGINT
);
-- A trusted hardware key names at most one node: the rule behind reclaims and racing joins.
CREATE UNIQUE INDEX nodes_trusted_hardware_key ON nodes (hardware_key)
    WHERE hardware_key_trusted = 1 AND hardware_key IS NOT NULL;

CREATE TABLE node_certs (
    serial               TEXT PRIMARY KEY,  -- hex
    node_id              TEXT NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    identity_generation  BIGINT NOT NULL,
    role                 TEXT NOT NULL,
    spki_sha256          TEXT NOT NULL,     -- hex
    der                  BYTEA NOT NULL,
    not_before           BIGINT NOT NULL,
    not_after            BIGINT NOT NULL,
    revoked_at           BIGINT,
    revoke_reason        TEXT,
    created_at           BIGINT NOT NULL,
    rowid                BIGSERIAL          -- the order rows were written in (SQLite's rowid)
);
CREATE INDEX node_certs_node ON node_certs (node_id);

CREATE TABLE events (
    seq         BIGSERIAL PRIMARY KEY,
    id          TEXT NOT NULL UNIQUE,
    tenant_id   TEXT NOT NULL,
    type        TEXT NOT NULL,
    data        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE INDEX events_tenant ON events (tenant_id, seq);

CREATE TABLE audit (
    seq         BIGSERIAL PRIMARY KEY,
    tenant_id   TEXT NOT NULL,
    action      TEXT NOT NULL,
    actor       TEXT NOT NULL,
    target      TEXT NOT NULL,
    data        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
