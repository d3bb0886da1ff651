-- PostgreSQL's form of ../0008_acceptance.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- Acceptance (a pool's `policy.acceptance`): a node stays `adopting` until its checks pass.
--
-- `conditions`: a JSON array of the node's conditions (`AcceptanceFailed` with its reason,
-- message and since), NULL when it has none. `hello_facts`: what its last `Hello` signed by its
-- node key showed (`{"skew": s, "claimsMatch": b}`), read again by `nodes.adopt`.
ALTER TABLE nodes ADD COLUMN conditions TEXT;
ALTER TABLE nodes ADD COLUMN hello_facts TEXT;

-- A pool's `policy.acceptance`, JSON (NULL: no checks, adopted at once).
ALTER TABLE pools ADD COLUMN acceptance TEXT;
