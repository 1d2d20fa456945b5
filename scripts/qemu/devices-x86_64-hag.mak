# Devices for the hag test hosts' qemu-system-x86_64 (QEMU 10.0.x), for
#   configure --without-default-devices --with-devices-x86_64=hag
# after copying this file to configs/devices/x86_64-softmmu/hag.mak.
# With --without-default-devices, Kconfig "default y" and "imply" are off
# (minikconf --allnoconfig), so everything the machine creates by default
# must be listed here.
CONFIG_I440FX=y
# "pc" creates these unless -machine hpet=off,vmport=off:
CONFIG_HPET=y
CONFIG_VMPORT=y
# -device virtio-net-pci, virtio-9p-pci (+ -fsdev local), virtio-serial
CONFIG_VIRTIO_PCI=y
CONFIG_VIRTIO_NET=y
CONFIG_VIRTIO_9P=y
CONFIG_VIRTIO_SERIAL=y
# Optional: -machine q35 (adds AHCI, ICH9 LPC, PCIe)
#CONFIG_Q35=y
