-- PostgreSQL's form of ../0006_discovery_trust.sql (the same tables, columns and constraints; BIGINT for
-- SQLite's INTEGER, BYTEA for BLOB, BIGSERIAL for AUTOINCREMENT).
-- Discovery must not take a machine's word for who it is (docs/boot.md "What the network saw").
--
-- Who recorded a node's identifiers (UUID, serials, MACs): `discovery` or `tpm` (an admission
-- that was vouched for by the network or a TPM), `approval` (an operator approved the machine),
-- or `token` (a join-token join wrote or rewrote them: the machine's own word, which never lets
-- a later discovery boot be admitted without an operator).
ALTER TABLE nodes ADD COLUMN identifiers_by TEXT NOT NULL DEFAULT 'token';
UPDATE nodes SET identifiers_by = attestor WHERE attestor IN ('discovery', 'tpm');

-- A discovery token remembers the address the network saw its MAC at (the DHCP sighting it was
-- minted for), or none when minting without a sighting was allowed (`[boot] require_sighting`).
ALTER TABLE discovery_tokens ADD COLUMN sighted_ip TEXT;

-- The token of a request's first deferral: a later join with it that claims another machine is
-- refused (`discovery:token-reused`), and minting never voids the token of an approved request.
ALTER TABLE join_requests ADD COLUMN token_id TEXT;
CREATE INDEX join_requests_token ON join_requests (token_id) WHERE token_id IS NOT NULL;
CREATE INDEX discovery_tokens_expiry ON discovery_tokens (expires_at);
