// SPDX-License-Identifier: GPL-2.0-only
/*
 * hag_mdev C glue: the static tables and macro-only helpers of the C
 * interfaces that Rust-for-Linux 6.12 does not wrap (miscdevice and its
 * file_operations, generic netlink, mdev, VFIO). It holds no logic: every
 * callback forwards through the table of Rust callbacks glue.rs registers
 * (struct hag_rs_ops, built there for the driver type), and every name and
 * number comes from Rust (which takes them from the shared hag_abi crate), so
 * the ABI is defined in one place. glue.rs is the only Rust file that calls
 * into this one.
 */
#include <linux/anon_inodes.h>
#include <linux/compat.h>
#include <linux/delay.h>
#include <linux/device.h>
#include <linux/eventfd.h>
#include <linux/interval_tree.h>
#include <linux/iova_bitmap.h>
#include <linux/workqueue.h>
#include <linux/fs.h>
#include <linux/mdev.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/slab.h>
#include <linux/vfio.h>
#include <net/genetlink.h>

#include "glue.h"

static bool allow_hang_injection;
module_param(allow_hang_injection, bool, 0444);
MODULE_PARM_DESC(allow_hang_injection,
		 "Let /dev/hag declare a vGPU hung on request (for tests; default off)");

bool hag_glue_hang_injection_allowed(void)
{
	return READ_ONCE(allow_hang_injection);
}

/*
 * Faults the tests inject: each shows that a check fails when what it
 * checks is missing. Compiled only into the test builds (make module,
 * gvt and debug pass HAG_TEST_SWITCHES=y): a production module has no such
 * parameter, and modinfo shows none.
 */
#ifdef HAG_TEST_SWITCHES
static bool withhold_gpu_dirty;
module_param(withhold_gpu_dirty, bool, 0444);
MODULE_PARM_DESC(withhold_gpu_dirty,
		 "Report no GPU-dirty pages through VFIO DMA logging (tests only: shows that a migration without them loses GPU writes; default off)");

static bool corrupt_mig_data;
module_param(corrupt_mig_data, bool, 0444);
MODULE_PARM_DESC(corrupt_mig_data,
		 "Flip one byte of every vGPU state this host hands out through VFIO migration (tests only: the target must refuse it; default off)");

static unsigned int test_hold_vgpu_ms;
module_param(test_hold_vgpu_ms, uint, 0444);
MODULE_PARM_DESC(test_hold_vgpu_ms,
		 "Hold each /dev/hag ioctl this long (ms, at most 10000) after it looked its vGPU up, as a user copy that blocks would (tests only: a vGPU removed meanwhile must refuse it; default 0)");
#else
static const bool withhold_gpu_dirty;
static const bool corrupt_mig_data;
static const unsigned int test_hold_vgpu_ms;
#endif

bool hag_glue_gpu_dirty_withheld(void)
{
	return READ_ONCE(withhold_gpu_dirty);
}

u32 hag_glue_test_hold_vgpu_ms(void)
{
	return min(READ_ONCE(test_hold_vgpu_ms), 10000U);
}

void hag_glue_msleep(u32 ms)
{
	msleep(ms);
}

bool hag_glue_fatal_signal_pending(void)
{
	return fatal_signal_pending(current);
}

void hag_glue_cond_resched(void)
{
	might_sleep();
	cond_resched();
}

/*
 * The Rust state and its callbacks, set for the whole time the interfaces
 * are registered.
 */
static const void *hag_ctx;
static const struct hag_rs_ops *hag_ops;
static u16 hag_pad_attr;

/* ---- /dev/hag --------------------------------------------------------- */

/*
 * Each open of /dev/hag has its own state, which Rust makes at open and
 * keeps in private_data: what the opener holds (a vGPU it quiesced) is let
 * go by that file's own release (the process closed it or died).
 */
static int hag_misc_open(struct inode *inode, struct file *file)
{
	const void *opened;
	int ret = hag_ops->open(hag_ctx, &opened);

	if (ret)
		return ret;
	file->private_data = (void *)opened;
	return 0;
}

static int hag_misc_release(struct inode *inode, struct file *file)
{
	hag_ops->release(hag_ctx, file->private_data);
	return 0;
}

static long hag_misc_ioctl(struct file *file, unsigned int cmd,
			   unsigned long arg)
{
	return hag_ops->ioctl(hag_ctx, file->private_data, cmd, arg);
}

static const struct file_operations hag_misc_fops = {
	.owner = THIS_MODULE,
	.open = hag_misc_open,
	.release = hag_misc_release,
	.unlocked_ioctl = hag_misc_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice hag_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.fops = &hag_misc_fops,
	.mode = 0600,
};

/* ---- generic netlink family ------------------------------------------ */

static struct genl_multicast_group hag_mcgrps[1];

static struct genl_family hag_genl_family = {
	.module = THIS_MODULE,
	.mcgrps = hag_mcgrps,
	.n_mcgrps = ARRAY_SIZE(hag_mcgrps),
	.netnsok = false,
};

int hag_glue_msg_new(struct hag_glue_msg *msg, u8 cmd)
{
	msg->skb = genlmsg_new(NLMSG_GOODSIZE, GFP_KERNEL);
	if (!msg->skb)
		return -ENOMEM;
	msg->hdr = genlmsg_put(msg->skb, 0, 0, &hag_genl_family, 0, cmd);
	if (!msg->hdr) {
		nlmsg_free(msg->skb);
		return -EMSGSIZE;
	}
	return 0;
}

int hag_glue_msg_put_u32(struct hag_glue_msg *msg, u16 attr, u32 value)
{
	return nla_put_u32(msg->skb, attr, value);
}

int hag_glue_msg_put_u64(struct hag_glue_msg *msg, u16 attr, u64 value)
{
	return nla_put_u64_64bit(msg->skb, attr, value, hag_pad_attr);
}

int hag_glue_msg_put_bytes(struct hag_glue_msg *msg, u16 attr,
			   const void *data, u32 len)
{
	return nla_put(msg->skb, attr, len, data);
}

/* Returns -ESRCH when nobody listens, which callers treat as delivered. */
int hag_glue_msg_multicast(struct hag_glue_msg *msg)
{
	genlmsg_end(msg->skb, msg->hdr);
	return genlmsg_multicast(&hag_genl_family, msg->skb, 0, 0, GFP_KERNEL);
}

void hag_glue_msg_cancel(struct hag_glue_msg *msg)
{
	nlmsg_free(msg->skb);
}

/* ---- mdev parent and the VFIO device of each vGPU -------------------- */

struct hag_vgpu {
	struct vfio_device vdev; /* first: vfio_alloc_device() requires it */
	/* hag's vGPU: the counted reference vgpu_probe gave, put at remove. */
	const void *rs;
	/* Runs the engine's slices and the watchdog: hag_ops->vgpu_tick(). */
	struct delayed_work tick;
};

static struct hag_vgpu *to_hag_vgpu(struct vfio_device *vdev)
{
	return container_of(vdev, struct hag_vgpu, vdev);
}

static void hag_vgpu_tick(struct work_struct *work)
{
	struct hag_vgpu *vgpu =
		container_of(to_delayed_work(work), struct hag_vgpu, tick);

	hag_ops->vgpu_tick(hag_ctx, vgpu->rs);
}

int hag_glue_dma_rw(struct hag_vgpu *vgpu, u64 gpa, void *data, u64 len,
		    bool write)
{
	return vfio_dma_rw(&vgpu->vdev, gpa, data, len, write);
}

/*
 * The engine (the simulated GPU) runs on an unbound workqueue: a GPU is not
 * the CPU that rang its doorbell, and a bound queue would run it on the
 * submitting vCPU's CPU, taking that CPU from the VM (and from an isolated
 * CPU, which the unbound queues' housekeeping mask keeps it off).
 */
void hag_glue_kick(struct hag_vgpu *vgpu, u32 delay_ms)
{
	mod_delayed_work(system_unbound_wq, &vgpu->tick,
			 msecs_to_jiffies(delay_ms));
}

struct eventfd_ctx *hag_glue_eventfd_get(int fd)
{
	struct eventfd_ctx *ctx = eventfd_ctx_fdget(fd);

	return IS_ERR(ctx) ? NULL : ctx;
}

void hag_glue_eventfd_signal(struct eventfd_ctx *ctx)
{
	eventfd_signal(ctx);
}

void hag_glue_eventfd_put(struct eventfd_ctx *ctx)
{
	eventfd_ctx_put(ctx);
}

/* ---- VFIO migration v2 ------------------------------------------------ */
/*
 * The state machine and the data files' contents are Rust's
 * (migration.rs); here are VFIO's path helper and the files themselves,
 * whose private_data is Rust's @migf.
 */

bool hag_glue_mig_data_corrupted(void)
{
	return READ_ONCE(corrupt_mig_data);
}

int hag_glue_mig_next_state(struct vfio_device *vdev, u32 cur, u32 target,
			    u32 *next)
{
	enum vfio_device_mig_state state;
	int ret = vfio_mig_get_next_state(vdev, cur, target, &state);

	*next = state;
	return ret;
}

static int hag_mig_release(struct inode *inode, struct file *filp)
{
	hag_ops->mig_file_release(hag_ctx, filp->private_data);
	return 0;
}

/* Stream files: no position of their own (Rust keeps the read offset). */
static ssize_t hag_mig_read(struct file *filp, char __user *buf, size_t len,
			    loff_t *pos)
{
	if (pos)
		return -ESPIPE;
	return hag_ops->mig_file_read(hag_ctx, filp->private_data, buf, len);
}

static ssize_t hag_mig_write(struct file *filp, const char __user *buf,
			     size_t len, loff_t *pos)
{
	if (pos)
		return -ESPIPE;
	return hag_ops->mig_file_write(hag_ctx, filp->private_data, buf, len);
}

static const struct file_operations hag_mig_save_fops = {
	.owner = THIS_MODULE,
	.read = hag_mig_read,
	.release = hag_mig_release,
};

static const struct file_operations hag_mig_resume_fops = {
	.owner = THIS_MODULE,
	.write = hag_mig_write,
	.release = hag_mig_release,
};

/* A data file to read (or, @write, to write) whose contents are @migf. */
int hag_glue_mig_file(const void *migf, bool write, struct file **filp)
{
	struct file *f = anon_inode_getfile("hag_mig",
					    write ? &hag_mig_resume_fops :
						    &hag_mig_save_fops,
					    (void *)migf,
					    write ? O_WRONLY : O_RDONLY);

	if (IS_ERR(f))
		return PTR_ERR(f);
	stream_open(f->f_inode, f);
	*filp = f;
	return 0;
}

void hag_glue_fput(struct file *filp)
{
	fput(filp);
}

/* The migration ops of the vGPU @rs, for hag-sim's device and GVT-g's. */
static struct file *hag_mig_set_state_of(const void *rs,
					 struct vfio_device *vdev,
					 enum vfio_device_mig_state new_state)
{
	struct file *filp = NULL;
	int ret = hag_ops->mig_set_state(hag_ctx, rs, vdev, new_state, &filp);

	return ret ? ERR_PTR(ret) : filp;
}

static int hag_mig_get_data_size_of(const void *rs,
				    unsigned long *stop_copy_length)
{
	long bytes = hag_ops->mig_data_bytes(hag_ctx, rs);

	if (bytes < 0)
		return bytes;
	*stop_copy_length = bytes;
	return 0;
}

static struct file *hag_mig_set_state(struct vfio_device *vdev,
				      enum vfio_device_mig_state new_state)
{
	return hag_mig_set_state_of(to_hag_vgpu(vdev)->rs, vdev, new_state);
}

static int hag_mig_get_state(struct vfio_device *vdev,
			     enum vfio_device_mig_state *state)
{
	*state = hag_ops->mig_get_state(hag_ctx, to_hag_vgpu(vdev)->rs);
	return 0;
}

static int hag_mig_get_data_size(struct vfio_device *vdev,
				 unsigned long *stop_copy_length)
{
	return hag_mig_get_data_size_of(to_hag_vgpu(vdev)->rs,
					stop_copy_length);
}

static const struct vfio_migration_ops hag_mig_ops = {
	.migration_set_state = hag_mig_set_state,
	.migration_get_state = hag_mig_get_state,
	.migration_get_data_size = hag_mig_get_data_size,
};

static ssize_t hag_vfio_read(struct vfio_device *vdev, char __user *buf,
			     size_t count, loff_t *ppos)
{
	return hag_ops->vfio_rw(hag_ctx, to_hag_vgpu(vdev)->rs, buf, count,
				*ppos, false);
}

static ssize_t hag_vfio_write(struct vfio_device *vdev, const char __user *buf,
			      size_t count, loff_t *ppos)
{
	return hag_ops->vfio_rw(hag_ctx, to_hag_vgpu(vdev)->rs,
				(char __user *)buf, count, *ppos, true);
}

/* A reset device is RUNNING again (uapi/linux/vfio.h): Rust sees to it. */
static long hag_vfio_ioctl(struct vfio_device *vdev, unsigned int cmd,
			   unsigned long arg)
{
	return hag_ops->vfio_ioctl(hag_ctx, to_hag_vgpu(vdev)->rs, cmd, arg);
}

static int hag_vfio_open_device(struct vfio_device *vdev)
{
	hag_ops->vgpu_open(hag_ctx, to_hag_vgpu(vdev)->rs, true);
	return 0;
}

/* Files the VMM still holds read and write nothing from here on. */
static void hag_vfio_close_device(struct vfio_device *vdev)
{
	hag_ops->vgpu_open(hag_ctx, to_hag_vgpu(vdev)->rs, false);
}

/*
 * VFIO's DMA-logging interface (VFIO_DEVICE_FEATURE_DMA_LOGGING_*), so an
 * unmodified VMM reads the GPU dirty bits too. Its bitmap helpers exist
 * only with CONFIG_IOMMUFD_DRIVER; without it the feature stays ENOTTY.
 */
#if IS_ENABLED(CONFIG_IOMMUFD_DRIVER)
/*
 * Starts DMA logging of the vGPU @rs over @ranges, at 4 KiB pages, one bitmap
 * per range: not one over their span, which with OVMF's 64-bit PCI hole at
 * the top of the address space would be terabytes. VFIO checked each range
 * (aligned, non-empty, no overlap); dirty.rs caps what they cover in all.
 */
static int hag_log_start_of(const void *rs, struct rb_root_cached *ranges,
			    u32 nnodes, u64 *page_size)
{
	struct hag_log_range spans[HAG_LOG_MAX_RANGES];
	struct interval_tree_node *node;
	u32 n = 0;

	if (nnodes > HAG_LOG_MAX_RANGES)
		vfio_combine_iova_ranges(ranges, nnodes, HAG_LOG_MAX_RANGES);
	for (node = interval_tree_iter_first(ranges, 0, ULONG_MAX); node;
	     node = interval_tree_iter_next(node, 0, ULONG_MAX)) {
		if (n == HAG_LOG_MAX_RANGES)
			return -E2BIG;
		spans[n].iova = node->start;
		spans[n].length = node->last - node->start + 1;
		n++;
	}
	*page_size = SZ_4K;
	return hag_ops->dma_log_start(hag_ctx, rs, spans, n);
}

static int hag_log_start(struct vfio_device *vdev,
			 struct rb_root_cached *ranges, u32 nnodes,
			 u64 *page_size)
{
	return hag_log_start_of(to_hag_vgpu(vdev)->rs, ranges, nnodes,
				page_size);
}

static int hag_log_stop(struct vfio_device *vdev)
{
	return hag_ops->dma_log_stop(hag_ctx, to_hag_vgpu(vdev)->rs);
}

static int hag_log_read_and_clear(struct vfio_device *vdev,
				  unsigned long iova, unsigned long length,
				  struct iova_bitmap *dirty)
{
	return hag_ops->dma_log_report(hag_ctx, to_hag_vgpu(vdev)->rs, iova,
				       length, dirty);
}

static const struct vfio_log_ops hag_log_ops = {
	.log_start = hag_log_start,
	.log_stop = hag_log_stop,
	.log_read_and_clear = hag_log_read_and_clear,
};

void hag_glue_iova_bitmap_set(void *dirty, u64 iova, u64 length)
{
	iova_bitmap_set(dirty, iova, length);
}
MODULE_IMPORT_NS(IOMMUFD);
#else
/* glue.rs links against it; without log ops VFIO never asks for a report. */
void hag_glue_iova_bitmap_set(void *dirty, u64 iova, u64 length)
{
	WARN_ON_ONCE(1);
}
#endif

static const struct vfio_device_ops hag_vfio_ops = {
	.name = "hag-sim",
	.open_device = hag_vfio_open_device,
	.close_device = hag_vfio_close_device,
	.read = hag_vfio_read,
	.write = hag_vfio_write,
	.ioctl = hag_vfio_ioctl,
	.bind_iommufd = vfio_iommufd_emulated_bind,
	.unbind_iommufd = vfio_iommufd_emulated_unbind,
	.attach_ioas = vfio_iommufd_emulated_attach_ioas,
	.detach_ioas = vfio_iommufd_emulated_detach_ioas,
};

static int hag_mdev_probe(struct mdev_device *mdev)
{
	struct hag_vgpu *vgpu;
	int ret;

	vgpu = vfio_alloc_device(hag_vgpu, vdev, &mdev->dev, &hag_vfio_ops);
	if (IS_ERR(vgpu))
		return PTR_ERR(vgpu);

	INIT_DELAYED_WORK(&vgpu->tick, hag_vgpu_tick);
	vgpu->vdev.migration_flags = VFIO_MIGRATION_STOP_COPY;
	vgpu->vdev.mig_ops = &hag_mig_ops;
#if IS_ENABLED(CONFIG_IOMMUFD_DRIVER)
	vgpu->vdev.log_ops = &hag_log_ops;
#endif
	ret = hag_ops->vgpu_probe(hag_ctx, mdev->uuid.b, vgpu, &vgpu->rs);
	if (ret)
		goto err_put;

	ret = vfio_register_emulated_iommu_dev(&vgpu->vdev);
	if (ret)
		goto err_remove;
	dev_set_drvdata(&mdev->dev, vgpu);
	return 0;

err_remove:
	hag_ops->vgpu_remove(hag_ctx, vgpu->rs);
	cancel_delayed_work_sync(&vgpu->tick);
	hag_ops->vgpu_put(hag_ctx, vgpu->rs);
err_put:
	vfio_put_device(&vgpu->vdev);
	return ret;
}

static void hag_mdev_remove(struct mdev_device *mdev)
{
	struct hag_vgpu *vgpu = dev_get_drvdata(&mdev->dev);

	/* No VFIO access after this returns. */
	vfio_unregister_group_dev(&vgpu->vdev);
	/*
	 * Gone from hag's table before the tick is cancelled: a /dev/hag
	 * resume still running could otherwise kick it again after the
	 * cancel, on memory vfio_put_device frees. Once removed nothing
	 * kicks it, and a tick already queued finds no vGPU. The reference
	 * goes last: the tick borrows it.
	 */
	hag_ops->vgpu_remove(hag_ctx, vgpu->rs);
	cancel_delayed_work_sync(&vgpu->tick);
	hag_ops->vgpu_put(hag_ctx, vgpu->rs);
	vfio_put_device(&vgpu->vdev);
}

static const char *hag_sim_description;

static ssize_t hag_mdev_show_description(struct mdev_type *mtype, char *buf)
{
	return sysfs_emit(buf, "%s\n", hag_sim_description);
}

static struct mdev_driver hag_mdev_driver = {
	.device_api = VFIO_DEVICE_API_PCI_STRING,
	.driver = {
		.name = "hag_mdev",
		.owner = THIS_MODULE,
		.mod_name = KBUILD_MODNAME,
	},
	.probe = hag_mdev_probe,
	.remove = hag_mdev_remove,
	.show_description = hag_mdev_show_description,
};

static struct mdev_type hag_sim_type;
static struct mdev_type *hag_mdev_types[] = { &hag_sim_type };
static struct mdev_parent hag_parent;

/* Named at registration; also the prefix of the mdev type directories. */
static struct class hag_class;

static void hag_parent_release(struct device *dev)
{
	/* Static device: nothing to free. */
}

static struct device hag_parent_dev = {
	.class = &hag_class,
	.release = hag_parent_release,
};

/* ---- registration ----------------------------------------------------- */

/*
 * Registers netlink, then /dev/hag, then the mdev parent, so that every
 * interface a callback may use already exists when callbacks can start; on
 * failure, undoes what it did and returns the error.
 */
int hag_glue_register(const void *ctx, const struct hag_rs_ops *ops,
		      const struct hag_glue_config *cfg)
{
	int ret;

	hag_ctx = ctx;
	hag_ops = ops;
	hag_pad_attr = cfg->genl_pad_attr;
	hag_sim_description = cfg->sim_type_description;

	strscpy(hag_genl_family.name, cfg->genl_name, GENL_NAMSIZ);
	strscpy(hag_mcgrps[0].name, cfg->genl_mcgrp_events, GENL_NAMSIZ);
	/* Events name vGPUs and what their guests do: as private as /dev/hag. */
	hag_mcgrps[0].flags = GENL_MCAST_CAP_NET_ADMIN;
	hag_genl_family.version = cfg->genl_version;
	hag_genl_family.maxattr = cfg->genl_maxattr;
	ret = genl_register_family(&hag_genl_family);
	if (ret)
		goto err_ctx;

	hag_misc.name = cfg->misc_name;
	ret = misc_register(&hag_misc);
	if (ret)
		goto err_genl;

	hag_mdev_driver.max_instances = cfg->sim_max_instances;
	ret = mdev_register_driver(&hag_mdev_driver);
	if (ret)
		goto err_misc;

	hag_class.name = cfg->parent_name;
	ret = class_register(&hag_class);
	if (ret)
		goto err_driver;

	device_initialize(&hag_parent_dev);
	dev_set_name(&hag_parent_dev, "%s", cfg->parent_name);
	ret = device_add(&hag_parent_dev);
	if (ret)
		goto err_device;

	hag_sim_type.sysfs_name = cfg->sim_type_name;
	hag_sim_type.pretty_name = cfg->sim_type_description;
	ret = mdev_register_parent(&hag_parent, &hag_parent_dev,
				   &hag_mdev_driver, hag_mdev_types,
				   ARRAY_SIZE(hag_mdev_types));
	if (ret)
		goto err_device_add;
	return 0;

err_device_add:
	device_del(&hag_parent_dev);
err_device:
	put_device(&hag_parent_dev);
	class_unregister(&hag_class);
err_driver:
	mdev_unregister_driver(&hag_mdev_driver);
err_misc:
	misc_deregister(&hag_misc);
err_genl:
	genl_unregister_family(&hag_genl_family);
err_ctx:
	/* The Rust state this pointed to is dropped when loading fails. */
	hag_ctx = NULL;
	hag_ops = NULL;
	return ret;
}

/*
 * Removes the mdev parent first: that removes every vGPU, whose remove
 * callbacks still multicast their events; then the rest in reverse order.
 */
void hag_glue_unregister(void)
{
	mdev_unregister_parent(&hag_parent);
	device_unregister(&hag_parent_dev);
	class_unregister(&hag_class);
	mdev_unregister_driver(&hag_mdev_driver);
	misc_deregister(&hag_misc);
	genl_unregister_family(&hag_genl_family);
	hag_ctx = NULL;
	hag_ops = NULL;
}

/* ---- GVT-g ------------------------------------------------------------ */
/*
 * Against a kernel whose i915 carries scripts/gvt/ (the workload audit
 * interface) hag observes GVT-g vGPUs; against any other kernel the same
 * functions exist and say GVT-g support is not compiled in, so glue.rs
 * needs no conditional code.
 */
#if IS_ENABLED(CONFIG_DRM_I915_GVT_KVMGT) && __has_include(<drm/intel/gvt_audit.h>)
#define HAG_GVT 1
#include <drm/intel/gvt_audit.h>

static_assert((int)HAG_GVT_PART_VREGS == (int)INTEL_GVT_AUDIT_VREGS);
static_assert((int)HAG_GVT_PART_CFG_SPACE == (int)INTEL_GVT_AUDIT_CFG_SPACE);
static_assert((int)HAG_GVT_PART_GGTT == (int)INTEL_GVT_AUDIT_GGTT);
static_assert((int)HAG_GVT_PART_EXECLIST == (int)INTEL_GVT_AUDIT_EXECLIST);

/*
 * A GVT-g vGPU whose VFIO device (kvmgt's) delegates its migration and
 * DMA logging to hag (gvt_audit.h's vfio ops): hag runs them with the same
 * code as for its own vGPUs, on the vGPU @rs that gvt_vgpu_added gave.
 */
struct hag_gvt_dev {
	struct list_head link; /* in hag_gvt_devs */
	struct intel_vgpu *vgpu;
	const void *rs;
};

static LIST_HEAD(hag_gvt_devs);
static DEFINE_MUTEX(hag_gvt_devs_lock);

/* The device of @vgpu; it lives until vgpu_removed, after which GVT makes
 * no call for @vgpu. */
static struct hag_gvt_dev *hag_gvt_dev_of(struct intel_vgpu *vgpu)
{
	struct hag_gvt_dev *dev, *found = NULL;

	mutex_lock(&hag_gvt_devs_lock);
	list_for_each_entry(dev, &hag_gvt_devs, link) {
		if (dev->vgpu == vgpu) {
			found = dev;
			break;
		}
	}
	mutex_unlock(&hag_gvt_devs_lock);
	return found;
}

static int hag_gvt_vgpu_added(struct intel_vgpu *vgpu, unsigned int id)
{
	struct hag_gvt_dev *dev = kzalloc(sizeof(*dev), GFP_KERNEL);
	int ret;

	if (!dev)
		return -ENOMEM;
	ret = hag_ops->gvt_vgpu_added(hag_ctx, vgpu, id, &dev->rs);
	if (ret) {
		kfree(dev);
		return ret;
	}
	dev->vgpu = vgpu;
	mutex_lock(&hag_gvt_devs_lock);
	list_add_tail(&dev->link, &hag_gvt_devs);
	mutex_unlock(&hag_gvt_devs_lock);
	return 0;
}

static void hag_gvt_vgpu_removed(struct intel_vgpu *vgpu)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);
	const void *rs = NULL;

	if (dev) {
		mutex_lock(&hag_gvt_devs_lock);
		list_del(&dev->link);
		mutex_unlock(&hag_gvt_devs_lock);
		rs = dev->rs;
		kfree(dev);
	}
	hag_ops->gvt_vgpu_removed(hag_ctx, vgpu, rs);
}

static struct file *hag_gvt_mig_set_state(struct intel_vgpu *vgpu,
					  struct vfio_device *vdev,
					  enum vfio_device_mig_state state)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	return dev ? hag_mig_set_state_of(dev->rs, vdev, state) :
		     ERR_PTR(-ENODEV);
}

static int hag_gvt_mig_get_state(struct intel_vgpu *vgpu,
				 enum vfio_device_mig_state *state)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	if (!dev)
		return -ENODEV;
	*state = hag_ops->mig_get_state(hag_ctx, dev->rs);
	return 0;
}

static int hag_gvt_mig_get_data_size(struct intel_vgpu *vgpu,
				     unsigned long *stop_copy_length)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	return dev ? hag_mig_get_data_size_of(dev->rs, stop_copy_length) :
		     -ENODEV;
}

static void hag_gvt_vfio_reset(struct intel_vgpu *vgpu)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	if (dev)
		hag_ops->mig_reset(hag_ctx, dev->rs);
}

#if IS_ENABLED(CONFIG_IOMMUFD_DRIVER)
static int hag_gvt_log_start(struct intel_vgpu *vgpu,
			     struct rb_root_cached *ranges, u32 nnodes,
			     u64 *page_size)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	return dev ? hag_log_start_of(dev->rs, ranges, nnodes, page_size) :
		     -ENODEV;
}

static int hag_gvt_log_stop(struct intel_vgpu *vgpu)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	return dev ? hag_ops->dma_log_stop(hag_ctx, dev->rs) : -ENODEV;
}

static int hag_gvt_log_read_and_clear(struct intel_vgpu *vgpu,
				      unsigned long iova, unsigned long length,
				      struct iova_bitmap *dirty)
{
	struct hag_gvt_dev *dev = hag_gvt_dev_of(vgpu);

	return dev ? hag_ops->dma_log_report(hag_ctx, dev->rs, iova, length,
					     dirty) : -ENODEV;
}
#else
static int hag_gvt_log_start(struct intel_vgpu *vgpu,
			     struct rb_root_cached *ranges, u32 nnodes,
			     u64 *page_size)
{
	return -EOPNOTSUPP;
}

static int hag_gvt_log_stop(struct intel_vgpu *vgpu)
{
	return -EOPNOTSUPP;
}

static int hag_gvt_log_read_and_clear(struct intel_vgpu *vgpu,
				      unsigned long iova, unsigned long length,
				      struct iova_bitmap *dirty)
{
	return -EOPNOTSUPP;
}
#endif

static const struct intel_gvt_audit_vfio_ops hag_gvt_vfio_ops = {
	.migration_set_state = hag_gvt_mig_set_state,
	.migration_get_state = hag_gvt_mig_get_state,
	.migration_get_data_size = hag_gvt_mig_get_data_size,
	.log_start = hag_gvt_log_start,
	.log_stop = hag_gvt_log_stop,
	.log_read_and_clear = hag_gvt_log_read_and_clear,
	.reset = hag_gvt_vfio_reset,
};

/* Batch buffers per workload handed over without an allocation. */
#define HAG_GVT_BBS_ON_STACK 8

static void hag_gvt_workload_scanned(const struct intel_gvt_audit_workload *wl)
{
	struct hag_gvt_bb on_stack[HAG_GVT_BBS_ON_STACK];
	struct hag_gvt_bb *bbs = on_stack;
	struct hag_gvt_wl w = {
		.cookie = wl->cookie,
		.engine = wl->engine,
		.incomplete = wl->incomplete,
		.ring = wl->ring,
		.ring_bytes = wl->ring_bytes,
		.nr_bbs = wl->nr_bbs,
		.ring_gma = wl->ring_gma,
		.hwsp_gma = wl->hwsp_gma,
		.indirect_ctx = wl->indirect_ctx,
		.indirect_ctx_bytes = wl->indirect_ctx_bytes,
		.indirect_ctx_gma = wl->indirect_ctx_gma,
	};
	unsigned int i;

	/*
	 * Without memory for the copy, hand over no array: hag then takes
	 * its conservative set instead of failing a workload GVT accepted.
	 */
	if (wl->nr_bbs > ARRAY_SIZE(on_stack))
		bbs = kmalloc_array(wl->nr_bbs, sizeof(*bbs), GFP_KERNEL);
	for (i = 0; bbs && i < wl->nr_bbs; i++) {
		bbs[i].gma = wl->bbs[i].gma;
		bbs[i].va = wl->bbs[i].va;
		bbs[i].size = wl->bbs[i].size;
		bbs[i].ppgtt = wl->bbs[i].ppgtt;
	}
	w.bbs = bbs;
	hag_ops->gvt_workload(hag_ctx, wl, wl->vgpu, &w);
	if (bbs != on_stack)
		kfree(bbs);
}

static void hag_gvt_workload_done(struct intel_vgpu *vgpu, u64 cookie,
				  bool changed)
{
	hag_ops->gvt_workload_done(hag_ctx, vgpu, cookie, changed);
}

static bool hag_gvt_batch_check(struct intel_vgpu *vgpu)
{
	return hag_ops->gvt_batch_check(hag_ctx, vgpu);
}

static void hag_gvt_gtt_mapped(struct intel_vgpu *vgpu, u64 gfn, u64 nr)
{
	hag_ops->gvt_gtt_mapped(hag_ctx, vgpu, gfn, nr);
}

static void hag_gvt_aperture_mapped(struct intel_vgpu *vgpu, u64 gfn, u64 nr)
{
	hag_ops->gvt_aperture_mapped(hag_ctx, vgpu, gfn, nr);
}

static void hag_gvt_guest_written(struct intel_vgpu *vgpu, u64 gpa, u64 len)
{
	hag_ops->gvt_guest_written(hag_ctx, vgpu, gpa, len);
}

static void hag_gvt_pages_mapped(struct intel_vgpu *vgpu, u64 gfn, u64 nr,
				 bool map)
{
	hag_ops->gvt_pages_mapped(hag_ctx, vgpu, gfn, nr, map);
}

static const struct intel_gvt_audit_ops hag_gvt_ops = {
	.vgpu_added = hag_gvt_vgpu_added,
	.vgpu_removed = hag_gvt_vgpu_removed,
	.workload_scanned = hag_gvt_workload_scanned,
	.workload_done = hag_gvt_workload_done,
	.guest_written = hag_gvt_guest_written,
	.pages_mapped = hag_gvt_pages_mapped,
	.gtt_mapped = hag_gvt_gtt_mapped,
	.aperture_mapped = hag_gvt_aperture_mapped,
	.batch_check = hag_gvt_batch_check,
	.owner = THIS_MODULE,
	.vfio = &hag_gvt_vfio_ops,
};

static bool hag_gvt_registered;

bool hag_gvt_compiled_in(void)
{
	return true;
}

int hag_gvt_register(void)
{
	int ret = intel_gvt_audit_register(&hag_gvt_ops);

	hag_gvt_registered = !ret;
	return ret;
}

void hag_gvt_unregister(void)
{
	if (hag_gvt_registered)
		intel_gvt_audit_unregister(&hag_gvt_ops);
	hag_gvt_registered = false;
}

unsigned int hag_gvt_nr_devices(void)
{
	return intel_gvt_audit_nr_devices();
}

int hag_gvt_gma_to_gfn(const void *wl, u64 gma, u32 ppgtt, u64 *gfn)
{
	return intel_gvt_audit_gma_to_gfn(wl, gma, ppgtt, gfn);
}

u64 hag_gvt_ggtt_size(void *vgpu)
{
	return intel_gvt_audit_ggtt_size(vgpu);
}

int hag_gvt_wait_idle(void *vgpu)
{
	return intel_gvt_audit_wait_idle(vgpu);
}

void hag_gvt_mark_aperture(void *vgpu)
{
	intel_gvt_audit_mark_aperture(vgpu);
}

long hag_gvt_part_size(void *vgpu, u32 part)
{
	return intel_gvt_audit_part_size(vgpu, part);
}

int hag_gvt_save_part(void *vgpu, u32 part, void *buf, size_t len)
{
	return intel_gvt_audit_save_part(vgpu, part, buf, len);
}

int hag_gvt_check_part(void *vgpu, u32 part, const void *buf, size_t len)
{
	return intel_gvt_audit_check_part(vgpu, part, buf, len);
}

int hag_gvt_restore_part(void *vgpu, u32 part, const void *buf, size_t len)
{
	return intel_gvt_audit_restore_part(vgpu, part, buf, len);
}

#else /* no GVT-g, or a GVT-g without the audit interface */

bool hag_gvt_compiled_in(void)
{
	return false;
}

int hag_gvt_register(void)
{
	return -ENODEV;
}

void hag_gvt_unregister(void)
{
}

unsigned int hag_gvt_nr_devices(void)
{
	return 0;
}

int hag_gvt_gma_to_gfn(const void *wl, u64 gma, u32 ppgtt, u64 *gfn)
{
	return -ENODEV;
}

u64 hag_gvt_ggtt_size(void *vgpu)
{
	return 0;
}

int hag_gvt_wait_idle(void *vgpu)
{
	return -ENODEV;
}

void hag_gvt_mark_aperture(void *vgpu)
{
}

long hag_gvt_part_size(void *vgpu, u32 part)
{
	return -ENODEV;
}

int hag_gvt_save_part(void *vgpu, u32 part, void *buf, size_t len)
{
	return -ENODEV;
}

int hag_gvt_check_part(void *vgpu, u32 part, const void *buf, size_t len)
{
	return -ENODEV;
}

int hag_gvt_restore_part(void *vgpu, u32 part, const void *buf, size_t len)
{
	return -ENODEV;
}

#endif
