-- PostgreSQL's form of ../0009_provisioned.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- A `provisioned` token (`nodes.provisionToken`) is minted for one node: a machine the discovery
-- ramdisk brought in, whose installed operating system then joins as that node, role `node`.
ALTER TABLE join_tokens ADD COLUMN node_id TEXT;
CREATE INDEX join_tokens_node ON join_tokens (node_id) WHERE node_id IS NOT NULL;
