#!/usr/bin/env bash
# What the network-boot tests and `make image` need: QEMU (from bookworm-backports, so the
# preinstalled qemu-utils 10 stays), its iPXE option ROMs, OVMF, Debian's iPXE binaries, busybox,
# cpio, dnsmasq (the site DHCP server of the proxy-mode test), kmod (depmod), iproute2 and
# sbsigntool (make image checks that shim, GRUB and the kernel are signed).
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if ! grep -rqs bookworm-backports /etc/apt/sources.list.d/; then
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  uri=${uri:-http://deb.debian.org/debian}
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" \
    | $SUDO tee /etc/apt/sources.list.d/backports.sources >/dev/null
  $SUDO apt-get update -qq
fi
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -f /usr/share/qemu/pxe-virtio.rom ] || [ -f /usr/lib/ipxe/qemu/pxe-virtio.rom ] || need+=(ipxe-qemu)
[ -f /usr/share/OVMF/OVMF_CODE.fd ] || [ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] || need+=(ovmf)
[ -f /usr/lib/ipxe/undionly.kpxe ] || need+=(ipxe)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
command -v dnsmasq >/dev/null || need+=(dnsmasq-base)
command -v depmod >/dev/null || need+=(kmod)
command -v ip >/dev/null || need+=(iproute2)
command -v sbverify >/dev/null || need+=(sbsigntool)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends -t bookworm-backports "${need[@]}" >/dev/null \
    || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
