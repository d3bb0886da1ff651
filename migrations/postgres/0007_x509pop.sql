-- PostgreSQL's form of ../0007_x509pop.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- The `x509pop` attestor's challenges: 32 random bytes the JoinService gave a machine coming back
-- after its certificate expired. Only their SHA-256 is kept; each lives 60 s and is answered once
-- (spent means deleted).
CREATE TABLE x509pop_challenges (
    id TEXT PRIMARY KEY,
    -- What limits count by (an IPv4 address, or an IPv6 /64).
    source TEXT NOT NULL,
    secret_sha256 BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    rowid                BIGSERIAL          -- the order rows were written in (SQLite's rowid)
);
CREATE INDEX x509pop_challenges_source ON x509pop_challenges (source);
CREATE INDEX x509pop_challenges_expiry ON x509pop_challenges (expires_at);
