-- The `tpm` attestor: the credential-activation challenges it hands out (single-use, the
-- secret's hash only) and the EK that admitted a node (a known EK reclaims its node).
CREATE TABLE tpm_challenges (
    id             TEXT PRIMARY KEY,
    ek_sha256      TEXT NOT NULL,
    ak_name        TEXT NOT NULL,
    secret_sha256  BLOB NOT NULL,
    ek_certified   INTEGER NOT NULL DEFAULT 0,   -- the EK certificate chains to the EK CA bundle
    created_at     INTEGER NOT NULL,
    expires_at     INTEGER NOT NULL,
    used_at        INTEGER
);
CREATE INDEX tpm_challenges_expiry ON tpm_challenges (expires_at);

ALTER TABLE nodes ADD COLUMN tpm_ek_sha256 TEXT;
CREATE INDEX nodes_tpm_ek ON nodes (tpm_ek_sha256) WHERE tpm_ek_sha256 IS NOT NULL;
