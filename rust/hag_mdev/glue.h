/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The interface between glue.c and glue.rs, both directions. glue.rs
 * mirrors these declarations; keep the two in step.
 */
#ifndef HAG_GLUE_H
#define HAG_GLUE_H

#include <linux/types.h>

/* Names and numbers, from hag_abi via glue.rs. Mirrors glue::GlueConfig. */
struct hag_glue_config {
	const char *misc_name;
	const char *parent_name;
	const char *sim_type_name;
	const char *sim_type_description;
	const char *genl_name;
	const char *genl_mcgrp_events;
	u32 sim_max_instances;
	u16 genl_maxattr;
	u16 genl_pad_attr;
	u8 genl_version;
};

struct hag_vgpu;
struct vfio_device;
struct file;

struct hag_gvt_wl;

/*
 * One range of guest addresses to DMA-log. hag keeps a bitmap per range, at
 * most HAG_LOG_MAX_RANGES of them (dirty.rs's MAX_SPANS): QEMU sends up to
 * three (RAM below 4 GiB, above it, and the 64-bit PCI hole), and VFIO's
 * helper merges more into that many.
 */
#define HAG_LOG_MAX_RANGES 4
struct hag_log_range {
	u64 iova;
	u64 length;
};

/*
 * The Rust callbacks, built by glue.rs for the driver type it registers
 * (as upstream's miscdevice.rs builds file_operations): every one takes
 * the registered context first. Mirrored by glue::RsOps. The pointers
 * Rust hands out and takes back (its `ForeignOwnable`s) are opaque
 * here: @opened, one open of /dev/hag (kept in the file's private_data
 * from open to release); @rs, a vGPU as its VFIO device reaches it (a
 * counted reference kept in the device's data: struct hag_vgpu's, or the
 * record of a GVT-g vGPU, from probe or gvt_vgpu_added until vgpu_put or
 * gvt_vgpu_removed); @migf, a VFIO migration data file's contents (in the
 * file's private_data until its release).
 */
struct hag_rs_ops {
	int (*open)(const void *ctx, const void **opened);
	long (*ioctl)(const void *ctx, const void *opened, unsigned int cmd,
		      unsigned long arg);
	void (*release)(const void *ctx, const void *opened);
	int (*vgpu_probe)(const void *ctx, const u8 *uuid,
			  struct hag_vgpu *vgpu, const void **rs);
	/* Gone from hag's table; @rs stays valid until vgpu_put. */
	void (*vgpu_remove)(const void *ctx, const void *rs);
	void (*vgpu_put)(const void *ctx, const void *rs);
	void (*vgpu_open)(const void *ctx, const void *rs, bool open);
	long (*vfio_rw)(const void *ctx, const void *rs, char __user *buf,
			size_t count, u64 pos, bool write);
	long (*vfio_ioctl)(const void *ctx, const void *rs, unsigned int cmd,
			   unsigned long arg);
	void (*vgpu_tick)(const void *ctx, const void *rs);
	/* VFIO DMA logging and migration, of either kind of vGPU. */
	int (*dma_log_start)(const void *ctx, const void *rs,
			     const struct hag_log_range *ranges, u32 count);
	int (*dma_log_stop)(const void *ctx, const void *rs);
	int (*dma_log_report)(const void *ctx, const void *rs, u64 iova,
			      u64 length, void *dirty);
	/* 0 and the file the last arc opened (or NULL), or a negative errno. */
	int (*mig_set_state)(const void *ctx, const void *rs,
			     struct vfio_device *vdev, u32 new_state,
			     struct file **filp);
	u32 (*mig_get_state)(const void *ctx, const void *rs);
	long (*mig_data_bytes)(const void *ctx, const void *rs);
	/* Back to RUNNING, no data session (GVT-g's device reset). */
	void (*mig_reset)(const void *ctx, const void *rs);
	long (*mig_file_read)(const void *ctx, const void *migf,
			      char __user *buf, size_t len);
	long (*mig_file_write)(const void *ctx, const void *migf,
			       const char __user *buf, size_t len);
	void (*mig_file_release)(const void *ctx, const void *migf);
	/* GVT-g (called only while registered with GVT). */
	int (*gvt_vgpu_added)(const void *ctx, void *vgpu, unsigned int id,
			      const void **rs);
	/* @rs: what gvt_vgpu_added gave, or NULL if it failed. */
	void (*gvt_vgpu_removed)(const void *ctx, void *vgpu, const void *rs);
	void (*gvt_workload)(const void *ctx, const void *wl, void *vgpu,
			     const struct hag_gvt_wl *w);
	void (*gvt_workload_done)(const void *ctx, void *vgpu, u64 cookie,
				  bool changed);
	bool (*gvt_batch_check)(const void *ctx, void *vgpu);
	void (*gvt_guest_written)(const void *ctx, void *vgpu, u64 gpa,
				  u64 len);
	void (*gvt_pages_mapped)(const void *ctx, void *vgpu, u64 gfn, u64 nr,
				 bool map);
	void (*gvt_gtt_mapped)(const void *ctx, void *vgpu, u64 gfn, u64 nr);
	void (*gvt_aperture_mapped)(const void *ctx, void *vgpu, u64 gfn,
				    u64 nr);
};

/* An event message under construction; freed by multicast or cancel. */
struct hag_glue_msg {
	struct sk_buff *skb;
	void *hdr;
};

/* Implemented in glue.c, called from glue.rs. */
int hag_glue_register(const void *ctx, const struct hag_rs_ops *ops,
		      const struct hag_glue_config *cfg);
void hag_glue_unregister(void);
int hag_glue_msg_new(struct hag_glue_msg *msg, u8 cmd);
int hag_glue_msg_put_u32(struct hag_glue_msg *msg, u16 attr, u32 value);
int hag_glue_msg_put_u64(struct hag_glue_msg *msg, u16 attr, u64 value);
int hag_glue_msg_put_bytes(struct hag_glue_msg *msg, u16 attr,
			   const void *data, u32 len);
int hag_glue_msg_multicast(struct hag_glue_msg *msg);
void hag_glue_msg_cancel(struct hag_glue_msg *msg);

/* Per-vGPU services for the device model. */
int hag_glue_dma_rw(struct hag_vgpu *vgpu, u64 gpa, void *data, u64 len,
		    bool write);
void hag_glue_kick(struct hag_vgpu *vgpu, u32 delay_ms);
struct eventfd_ctx *hag_glue_eventfd_get(int fd);
void hag_glue_eventfd_signal(struct eventfd_ctx *ctx);
void hag_glue_eventfd_put(struct eventfd_ctx *ctx);
bool hag_glue_hang_injection_allowed(void);
bool hag_glue_gpu_dirty_withheld(void);
u32 hag_glue_test_hold_vgpu_ms(void);
void hag_glue_msleep(u32 ms);
bool hag_glue_fatal_signal_pending(void);
void hag_glue_cond_resched(void);
void hag_glue_iova_bitmap_set(void *dirty, u64 iova, u64 length);
bool hag_glue_mig_data_corrupted(void);
int hag_glue_mig_next_state(struct vfio_device *vdev, u32 cur, u32 target,
			    u32 *next);
int hag_glue_mig_file(const void *migf, bool write, struct file **filp);
void hag_glue_fput(struct file *filp);

/*
 * GVT-g (glue.c's GVT section): hag as the observer of i915's workload
 * audit interface (include/drm/intel/gvt_audit.h, from scripts/gvt/),
 * flattened so that Rust needs no i915 header. vGPUs and workloads are
 * opaque pointers; a workload pointer is valid only during the
 * hag_rust_gvt_workload() call it is passed to. Against a kernel without
 * the interface, the calls fail with -ENODEV (or return 0 / false).
 */
struct hag_gvt_bb { /* one batch buffer GVT shadowed; mirrored in glue.rs */
	u64 gma; /* guest graphics address of the first shadowed byte */
	const void *va; /* GVT's copy, size bytes */
	u32 size; /* up to and including MI_BATCH_BUFFER_END */
	u32 ppgtt; /* 1: gma is in the context's PPGTT, 0: in the GGTT */
};

/* One workload GVT scanned; mirrored in glue.rs (see gvt_audit.h). */
struct hag_gvt_wl {
	u64 cookie; /* names it in gvt_workload_done */
	u32 engine;
	u32 incomplete; /* 1: GVT could not hand over all of it */
	const u32 *ring;
	u32 ring_bytes;
	u32 nr_bbs;
	u64 ring_gma;
	u64 hwsp_gma;
	const struct hag_gvt_bb *bbs; /* NULL if there was no memory for them */
	const u32 *indirect_ctx; /* NULL: none */
	u32 indirect_ctx_bytes;
	u32 pad;
	u64 indirect_ctx_gma;
};

/* Parts of a vGPU snapshot, in restore order (see gvt_audit.h). */
enum hag_gvt_part {
	HAG_GVT_PART_VREGS = 0,
	HAG_GVT_PART_CFG_SPACE = 1,
	HAG_GVT_PART_GGTT = 2,
	HAG_GVT_PART_EXECLIST = 3,
};

/* Implemented in glue.c. */
bool hag_gvt_compiled_in(void);
int hag_gvt_register(void);
void hag_gvt_unregister(void);
unsigned int hag_gvt_nr_devices(void);
int hag_gvt_gma_to_gfn(const void *wl, u64 gma, u32 ppgtt, u64 *gfn);
u64 hag_gvt_ggtt_size(void *vgpu);
int hag_gvt_wait_idle(void *vgpu);
void hag_gvt_mark_aperture(void *vgpu);
long hag_gvt_part_size(void *vgpu, u32 part);
int hag_gvt_save_part(void *vgpu, u32 part, void *buf, size_t len);
int hag_gvt_check_part(void *vgpu, u32 part, const void *buf, size_t len);
int hag_gvt_restore_part(void *vgpu, u32 part, const void *buf, size_t len);

#endif /* HAG_GLUE_H */
