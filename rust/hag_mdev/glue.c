// SPDX-License-Identifier: GPL-2.0-only
/*
 * hag_mdev C glue: the static tables and macro-only helpers of the C
 * interfaces that Rust-for-Linux 6.12 does not wrap (miscdevice and its
 * file_operations, generic netlink, mdev, VFIO). It holds no logic: every
 * callback forwards to a hag_rs_*() function in glue.rs, and every name and
 * number comes from Rust (which takes them from the shared hag_abi crate), so
 * the ABI is defined in one place. glue.rs is the only Rust file that calls
 * into this one.
 */
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

void hag_glue_msleep(u32 ms)
{
	msleep(ms);
}

/* The Rust state, set for the whole time the interfaces are registered. */
static const void *hag_ctx;
static u16 hag_pad_attr;

/* ---- /dev/hag --------------------------------------------------------- */

static long hag_misc_ioctl(struct file *file, unsigned int cmd,
			   unsigned long arg)
{
	return hag_rs_ioctl(hag_ctx, cmd, arg);
}

static const struct file_operations hag_misc_fops = {
	.owner = THIS_MODULE,
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
	u32 id;
	/* Runs the engine's slices and the watchdog: hag_rs_vgpu_tick(). */
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

	hag_rs_vgpu_tick(hag_ctx, vgpu->id);
}

int hag_glue_dma_rw(struct hag_vgpu *vgpu, u64 gpa, void *data, u64 len,
		    bool write)
{
	return vfio_dma_rw(&vgpu->vdev, gpa, data, len, write);
}

void hag_glue_kick(struct hag_vgpu *vgpu, u32 delay_ms)
{
	mod_delayed_work(system_wq, &vgpu->tick, msecs_to_jiffies(delay_ms));
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

static ssize_t hag_vfio_read(struct vfio_device *vdev, char __user *buf,
			     size_t count, loff_t *ppos)
{
	return hag_rs_vfio_rw(hag_ctx, to_hag_vgpu(vdev)->id, buf, count,
			      *ppos, false);
}

static ssize_t hag_vfio_write(struct vfio_device *vdev, const char __user *buf,
			      size_t count, loff_t *ppos)
{
	return hag_rs_vfio_rw(hag_ctx, to_hag_vgpu(vdev)->id, (char __user *)buf,
			      count, *ppos, true);
}

static long hag_vfio_ioctl(struct vfio_device *vdev, unsigned int cmd,
			   unsigned long arg)
{
	return hag_rs_vfio_ioctl(hag_ctx, to_hag_vgpu(vdev)->id, cmd, arg);
}

static int hag_vfio_open_device(struct vfio_device *vdev)
{
	hag_rs_vgpu_open(hag_ctx, to_hag_vgpu(vdev)->id, true);
	return 0;
}

static void hag_vfio_close_device(struct vfio_device *vdev)
{
	hag_rs_vgpu_open(hag_ctx, to_hag_vgpu(vdev)->id, false);
}

/*
 * VFIO's DMA-logging interface (VFIO_DEVICE_FEATURE_DMA_LOGGING_*), so an
 * unmodified VMM reads the GPU dirty bits too. Its bitmap helpers exist
 * only with CONFIG_IOMMUFD_DRIVER; without it the feature stays ENOTTY.
 */
#if IS_ENABLED(CONFIG_IOMMUFD_DRIVER)
static int hag_log_start(struct vfio_device *vdev,
			 struct rb_root_cached *ranges, u32 nnodes,
			 u64 *page_size)
{
	struct interval_tree_node *node;
	u64 first = U64_MAX, last = 0;

	/* hag logs one span at 4 KiB pages; VFIO checked the ranges. */
	for (node = interval_tree_iter_first(ranges, 0, ULONG_MAX); node;
	     node = interval_tree_iter_next(node, 0, ULONG_MAX)) {
		first = min_t(u64, first, node->start);
		last = max_t(u64, last, node->last);
	}
	if (first > last)
		return -EINVAL;
	*page_size = SZ_4K;
	return hag_rs_dma_log_start(hag_ctx, to_hag_vgpu(vdev)->id, first,
				    last - first + 1);
}

static int hag_log_stop(struct vfio_device *vdev)
{
	return hag_rs_dma_log_stop(hag_ctx, to_hag_vgpu(vdev)->id);
}

static int hag_log_read_and_clear(struct vfio_device *vdev,
				  unsigned long iova, unsigned long length,
				  struct iova_bitmap *dirty)
{
	return hag_rs_dma_log_report(hag_ctx, to_hag_vgpu(vdev)->id, iova,
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
#if IS_ENABLED(CONFIG_IOMMUFD_DRIVER)
	vgpu->vdev.log_ops = &hag_log_ops;
#endif
	ret = hag_rs_vgpu_probe(hag_ctx, mdev->uuid.b, vgpu, &vgpu->id);
	if (ret)
		goto err_put;

	ret = vfio_register_emulated_iommu_dev(&vgpu->vdev);
	if (ret)
		goto err_forget;
	dev_set_drvdata(&mdev->dev, vgpu);
	return 0;

err_forget:
	hag_rs_vgpu_remove(hag_ctx, vgpu->id);
err_put:
	vfio_put_device(&vgpu->vdev);
	return ret;
}

static void hag_mdev_remove(struct mdev_device *mdev)
{
	struct hag_vgpu *vgpu = dev_get_drvdata(&mdev->dev);

	/* No VFIO access after this returns, so nothing kicks the tick again. */
	vfio_unregister_group_dev(&vgpu->vdev);
	cancel_delayed_work_sync(&vgpu->tick);
	hag_rs_vgpu_remove(hag_ctx, vgpu->id);
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
int hag_glue_register(const void *ctx, const struct hag_glue_config *cfg)
{
	int ret;

	hag_ctx = ctx;
	hag_pad_attr = cfg->genl_pad_attr;
	hag_sim_description = cfg->sim_type_description;

	strscpy(hag_genl_family.name, cfg->genl_name, GENL_NAMSIZ);
	strscpy(hag_mcgrps[0].name, cfg->genl_mcgrp_events, GENL_NAMSIZ);
	hag_genl_family.version = cfg->genl_version;
	hag_genl_family.maxattr = cfg->genl_maxattr;
	ret = genl_register_family(&hag_genl_family);
	if (ret)
		return ret;

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
}
