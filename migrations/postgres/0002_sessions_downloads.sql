-- PostgreSQL's form of ../0002_sessions_downloads.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- Sessions: whether a node holds a live session, and when it was last heard from.
ALTER TABLE nodes ADD COLUMN connected BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN last_seen BIGINT;

-- Agent binaries the appliance serves to install scripts (air-gapped sites bring them on a stick).
CREATE TABLE downloads (
    product   TEXT NOT NULL,
    version   TEXT NOT NULL,
    arch      TEXT NOT NULL,
    sha256    TEXT NOT NULL,
    size      BIGINT NOT NULL,
    added_at  BIGINT NOT NULL,
    added_by  TEXT NOT NULL,
    PRIMARY KEY (product, version, arch)
);
