-- Provisioning networks behind a DHCP relay (`[[boot.subnets]]`): a boot lease records the relay
-- that forwarded the machine's packets (its `giaddr`), NULL when none did.
ALTER TABLE boot_leases ADD COLUMN relay TEXT;
