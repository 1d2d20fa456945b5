#!/usr/bin/env python3
"""Turns drm-shim execbuffer captures (drm-shim-capture.patch) into the
small corpus files rust/hag_gvt/tests/mesa.rs reads.

A capture holds every exec object of one execbuffer2 with its softpin
address and contents. This keeps what GVT-g would hand hag for it: the
batch buffers the GPU runs, each cut as GVT shadows it (from its start to
MI_BATCH_BUFFER_END or a chaining MI_BATCH_BUFFER_START), found by
following MI_BATCH_BUFFER_START from the batch the execbuffer names, and
the address and size of every object (what the guest's PPGTT maps for the
workload). Object contents other than batches are dropped.

Output, little endian: b"HAGMESA1", u32 engine (I915_EXEC_RING_MASK bits
of the execbuffer flags), u32 objects, u32 batches, u32 0, then per object
u64 address, u64 size, then per batch u64 address, u32 bytes, u32 0 and
the bytes (a multiple of 4).
"""
import struct
import sys

MASK48 = (1 << 48) - 1
MI_BATCH_BUFFER_END = 0x0A
MI_BATCH_BUFFER_START = 0x31


def read_capture(path):
    data = open(path, "rb").read()
    magic, version, flags, start, blen, count = struct.unpack_from("<6I", data, 0)
    if magic != 0x58474148 or version != 1:
        raise SystemExit(f"{path}: not a capture")
    off = 24
    objs = []
    for _ in range(count):
        handle, _pad, addr, oflags, size = struct.unpack_from("<IIQQQ", data, off)
        off += 32
        objs.append([handle, addr & MASK48, oflags, size, None])
    for o in objs:
        o[4] = data[off:off + o[3]]
        off += o[3]
    batch = objs[0] if flags & (1 << 18) else objs[-1]
    return flags, start, objs, batch


def cmd_len(dw):
    """Length in dwords of the GEN command starting with dword dw."""
    kind = dw >> 29
    if kind == 0:  # MI
        op = (dw >> 23) & 0x3F
        return 1 if op < 0x10 else (dw & 0xFF) + 2
    if kind == 2:  # 2D blitter
        return (dw & 0xFF) + 2
    if kind == 3:  # render: 3D, media, PIPE_CONTROL
        sub = (dw >> 27) & 3
        opc = (dw >> 24) & 7
        subop = (dw >> 16) & 0xFF
        if sub == 1 and ((opc, subop) == (1, 0x04) or (opc, subop) == (0, 0x0B)):
            # PIPELINE_SELECT and 3DSTATE_VF_STATISTICS are one dword.
            return 1
        return (dw & 0xFF) + 2
    return 1


def find(objs, addr, nbytes=4):
    for o in objs:
        if o[1] <= addr and addr + nbytes <= o[1] + o[3]:
            return o
    return None


def walk(objs, start_addr):
    """The batch segments reached from start_addr, as GVT shadows them."""
    segments = []
    seen = set()
    todo = [start_addr]
    while todo:
        addr = todo.pop()
        if addr in seen:
            continue
        seen.add(addr)
        obj = find(objs, addr)
        if obj is None:
            raise SystemExit(f"batch at {addr:#x} is in no object")
        base, content = obj[1], obj[4]
        pos = addr - base
        while True:
            if pos + 4 > len(content):
                raise SystemExit(f"batch at {addr:#x} runs off its object")
            dw = struct.unpack_from("<I", content, pos)[0]
            n = cmd_len(dw)
            if dw >> 29 == 0 and (dw >> 23) & 0x3F == MI_BATCH_BUFFER_END:
                pos += 4
                break
            if dw >> 29 == 0 and (dw >> 23) & 0x3F == MI_BATCH_BUFFER_START:
                lo, hi = struct.unpack_from("<II", content, pos + 4)
                target = (lo | hi << 32) & MASK48 & ~3
                todo.append(target)
                pos += n * 4
                if not dw & (1 << 22):  # chained: this segment ends here
                    break
                continue
            pos += n * 4
        segments.append((addr, content[addr - base:pos]))
    # The start first, the rest in address order.
    first = [s for s in segments if s[0] == start_addr]
    rest = sorted(s for s in segments if s[0] != start_addr)
    return first + rest


def main():
    out = sys.argv[1]
    flags, start, objs, batch = read_capture(sys.argv[2])
    segments = walk(objs, batch[1] + start)
    with open(out, "wb") as f:
        f.write(b"HAGMESA1")
        f.write(struct.pack("<4I", flags & 0x3F, len(objs), len(segments), 0))
        for o in objs:
            f.write(struct.pack("<QQ", o[1], o[3]))
        for addr, content in segments:
            f.write(struct.pack("<QII", addr, len(content), 0))
            f.write(content)


if __name__ == "__main__":
    main()
