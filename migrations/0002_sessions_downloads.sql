-- Sessions: whether a node holds a live session, and when it was last heard from.
ALTER TABLE nodes ADD COLUMN connected INTEGER NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN last_seen INTEGER;

-- Agent binaries the appliance serves to install scripts (air-gapped sites bring them on a stick).
CREATE TABLE downloads (
    product   TEXT NOT NULL,
    version   TEXT NOT NULL,
    arch      TEXT NOT NULL,
    sha256    TEXT NOT NULL,
    size      INTEGER NOT NULL,
    added_at  INTEGER NOT NULL,
    added_by  TEXT NOT NULL,
    PRIMARY KEY (product, version, arch)
);
