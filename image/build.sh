#!/usr/bin/env bash
# `make image`: the discovery ramdisk, image/out/vmlinuz and image/out/initrd.img, plus the iPXE
# binaries and the Secure Boot chain (Debian's signed shim and network GRUB) checked against
# firmware/SHA256SUMS. Everything comes from Debian's packages and the
# static bca binary, so the boot works air-gapped once built.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=image/out
BCA=${BCA_BIN:-target/x86_64-unknown-linux-musl/release/bca}
[ -x "$BCA" ] || { echo "image: $BCA is missing: run make build first" >&2; exit 1; }
file "$BCA" | grep -q 'static' || { echo "image: $BCA is not a static binary" >&2; exit 1; }
mkdir -p "$OUT"
# Progress: one line per step on stderr ("image: [2/5] ..."), the same on a terminal or in a log.
step() { echo "image: [$1/6] $2" >&2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The iPXE binaries, from Debian's ipxe package.
step 1 "iPXE binaries"
for f in undionly.kpxe ipxe.efi snponly.efi; do cp "/usr/lib/ipxe/$f" "$OUT/$f"; done

# The Secure Boot chain for `[boot] uefi_chain = "shim"`: Debian's shim (signed by Microsoft's
# UEFI CA) and network GRUB (signed by Debian, which shim trusts), taken from their packages with
# apt-get download and dpkg -x: the packages are never installed on this host.
step 2 "shim and GRUB (signed), then every boot binary checked against firmware/SHA256SUMS"
(cd "$work" && apt-get download shim-signed grub-efi-amd64-signed >/dev/null 2>&1) || {
  echo "image: apt-get download shim-signed grub-efi-amd64-signed failed (apt-get update?)" >&2; exit 1; }
for d in "$work"/shim-signed_*.deb "$work"/grub-efi-amd64-signed_*.deb; do dpkg -x "$d" "$work/sb"; done
cp "$work/sb/usr/lib/shim/shimx64.efi.signed" "$OUT/shimx64.efi"
# shim loads grubx64.efi from the folder it came from; the network image is the one with the
# tftp, http and efinet modules built in.
cp "$work/sb/usr/lib/grub/x86_64-efi-signed/grubnetx64.efi.signed" "$OUT/grubx64.efi"
(cd "$OUT" && sha256sum -c --quiet ../../firmware/SHA256SUMS) || {
  echo "image: the boot binaries do not match firmware/SHA256SUMS (see firmware/README.md)" >&2; exit 1; }
for d in "$work"/shim-signed_*.deb "$work"/grub-efi-amd64-signed_*.deb; do
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$d"
done > "$OUT/SECURE-BOOT-PACKAGES"

# The kernel: the package linux-image-amd64 points at.
step 3 "the kernel package (its vmlinuz signed by Debian)"
pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$pkg" ] || { echo "image: no kernel package found (apt-get update?)" >&2; exit 1; }
(cd "$work" && apt-get download "$pkg" >/dev/null 2>&1)
dpkg -x "$work"/linux-image-*.deb "$work/k"
kver=$(ls "$work/k/lib/modules")
depmod -b "$work/k" "$kver"
# Secure Boot: GRUB (through shim) boots only a kernel whose signature chains to Debian's key.
if command -v sbverify >/dev/null; then
  for f in "$OUT/shimx64.efi" "$OUT/grubx64.efi" "$work/k/boot/vmlinuz-$kver"; do
    sbverify --list "$f" 2>/dev/null | grep -q 'signature 1' || {
      echo "image: $f carries no Authenticode signature" >&2; exit 1; }
  done
fi

step 4 "busybox and bca"
root="$work/root"
mkdir -p "$root"/{bin,sbin,etc/bca-agent,proc,sys,dev,tmp,run,var/lib/bca-agent,lib/modules}
cp /bin/busybox "$root/bin/busybox"
for a in $("$root/bin/busybox" --list); do [ -e "$root/bin/$a" ] || ln -s busybox "$root/bin/$a"; done
cp "$BCA" "$root/bin/bca"
step 5 "NIC drivers"
# The NIC drivers a server needs, with their dependencies, in load order; and virtio_blk and
# ext4 (crc32c first: ext4 asks the crypto API for it, and nothing loads modules on demand), for
# the test image's other modes (image/init: an "installed OS", an appliance on a disk); efivarfs, for
# the Secure Boot state the ramdisk reports.
python3 image/modules.py "$work/k/lib/modules/$kver" \
  virtio_pci virtio_net e1000 e1000e igb ixgbe i40e ice mlx5_core bnxt_en virtio_blk \
  crc32c_generic ext4 efivarfs > "$work/order"
: > "$root/etc/modules.order"
while read -r m; do
  cp "$work/k/lib/modules/$kver/$m" "$root/lib/modules/"
  basename "$m" >> "$root/etc/modules.order"
done < "$work/order"
step 6 "initrd.img (newc cpio, gzip)"
install -m 0755 image/init "$root/init"
install -m 0755 image/udhcpc.script "$root/etc/udhcpc.script"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -6) > "$OUT/initrd.img"
cp "$work/k/boot/vmlinuz-$kver" "$OUT/vmlinuz"
echo "$pkg" > "$OUT/KERNEL"
ls -l "$OUT"
