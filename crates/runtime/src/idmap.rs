//! Idmapped mounts: a clone of a directory tree whose file owners are seen
//! through a user namespace's mappings (`mount_setattr(2)` with
//! `MOUNT_ATTR_IDMAP`, Linux ≥ 5.12; overlayfs takes idmapped lower layers
//! from 5.19).
//!
//! This is the one module of the crate with `unsafe`, and it holds one
//! block: neither `nix` nor `rustix` wraps `mount_setattr`, so it is called
//! through `libc::syscall`. `open_tree` and `move_mount` come from
//! `rustix`, safely. The crate denies `unsafe_code` everywhere else.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use rustix::fs::CWD;
use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};

/// `AT_EMPTY_PATH`: act on the file descriptor itself.
const AT_EMPTY_PATH: libc::c_uint = 0x1000;
/// `AT_RECURSIVE`: the whole tree under it too.
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// Sets `MOUNT_ATTR_IDMAP` with the user namespace `userns` on the
/// detached mount tree `tree` (from `open_tree(OPEN_TREE_CLONE)`).
fn set_idmap(tree: &OwnedFd, userns: &File) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: u64::try_from(userns.as_raw_fd()).map_err(io::Error::other)?,
    };
    let empty = c"";
    // SAFETY: mount_setattr(dirfd, path, flags, attr, size) reads `size`
    // bytes from `attr`, which points at a live, initialised `mount_attr`
    // of exactly that size on this stack frame; `path` is a valid
    // NUL-terminated string that outlives the call; both descriptors are
    // owned by the caller and stay open for the duration of the call. The
    // kernel writes no memory of ours, and the return value is checked.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            AT_EMPTY_PATH | AT_RECURSIVE,
            std::ptr::from_ref(&attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Mounts at `target` (an existing directory or file) a recursive clone of
/// `source` whose owners are mapped through the user namespace at
/// `userns` (a `/proc/<pid>/ns/user` or a pin of one): a file owned by
/// `k` on disk is owned by whatever `k` maps to in that namespace's
/// mappings. Blocking; mount work belongs on a dedicated thread.
pub(crate) fn mount_idmapped(source: &Path, target: &Path, userns: &Path) -> io::Result<()> {
    let ns = File::open(userns)?;
    let tree = open_tree(
        CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE,
    )?;
    set_idmap(&tree, &ns)?;
    move_mount(
        tree.as_fd(),
        "",
        CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}
