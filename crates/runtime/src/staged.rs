//! Recursive read-only bind mounts, staged on the node for runtimes that
//! cannot make them (runc before 1.2 has no `rro` option).
//!
//! A mount with CRI `recursive_read_only` is staged under
//! `<state_dir>/staged/<container>/<n>`: a recursive bind of the source, made
//! private (so a mount that later appears under the source on the node is
//! not propagated into the read-only tree as a writable one), then a
//! read-only bind-remount of the staged top and of every submount the mount
//! table shows under it, each keeping its other flags (`nosuid`, `nodev`,
//! `noexec`, atime). The runtime gets the staged tree as a plain recursive
//! read-only bind: a recursive bind copies each mount's read-only flag, so
//! the container sees every level read-only. `mount_setattr(2)` with
//! `AT_RECURSIVE` would do it in one call, but needs `unsafe` here; the
//! remounts are what containerd does on kernels without it.
//!
//! Once the task exists the container's mount namespace holds its own copy,
//! so the staged tree is unmounted when the task is created, when the
//! container is removed, and by the GC for containers nobody knows (a
//! daemon killed between staging and the container record). Every mount
//! system call runs on a dedicated thread, never on an async worker.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cubelet_host::mountinfo::{parse, MountEntry};
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::io_err;
use crate::error::RuntimeError;
use crate::spec::MountSpec;

/// The directory of staged mounts under the runtime's state dir.
pub(crate) const DIR: &str = "staged";

fn nix_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> RuntimeError + 'a {
    move |e| RuntimeError::Io {
        op,
        path: path.display().to_string(),
        source: io::Error::from(e),
    }
}

/// Runs blocking mount work on a thread of its own.
pub(crate) async fn on_thread<T, W>(work: W) -> Result<T, RuntimeError>
where
    W: FnOnce() -> Result<T, RuntimeError> + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cubelet-mounts".into())
        .spawn(move || {
            let _ = tx.send(work());
        })
        .map_err(|e| RuntimeError::FailedPrecondition(format!("mount thread: {e}")))?;
    rx.await.unwrap_or_else(|_| {
        Err(RuntimeError::FailedPrecondition(
            "mount thread panicked".into(),
        ))
    })
}

/// Mounts at or under `dir`, in the order the table lists them (parents
/// before children).
fn mounts_under(dir: &Path) -> Result<Vec<MountEntry>, RuntimeError> {
    let path = Path::new("/proc/thread-self/mountinfo");
    let text = fs::read_to_string(path).map_err(io_err("read", path))?;
    Ok(parse(&text)
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .collect())
}

/// The flags of a read-only bind-remount that keeps `options`' other
/// per-mount flags.
fn readonly_remount_flags(options: &str) -> MsFlags {
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for o in options.split(',') {
        flags |= match o {
            "nosuid" => MsFlags::MS_NOSUID,
            "nodev" => MsFlags::MS_NODEV,
            "noexec" => MsFlags::MS_NOEXEC,
            "noatime" => MsFlags::MS_NOATIME,
            "nodiratime" => MsFlags::MS_NODIRATIME,
            "relatime" => MsFlags::MS_RELATIME,
            "strictatime" => MsFlags::MS_STRICTATIME,
            _ => MsFlags::empty(),
        };
    }
    flags
}

/// Stages `source` at `target` (recursively): idmapped through the user
/// namespace at `userns` when given, read-only at every level when
/// `readonly`. Blocking.
fn stage_one(
    source: &Path,
    target: &Path,
    userns: Option<&Path>,
    readonly: bool,
) -> Result<(), RuntimeError> {
    let md = fs::metadata(source).map_err(io_err("stat mount source", source))?;
    if md.is_dir() {
        fs::create_dir_all(target).map_err(io_err("create", target))?;
    } else {
        if let Some(dir) = target.parent() {
            fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        }
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(target)
            .map_err(io_err("create", target))?;
    }
    let idmapped = match userns {
        Some(ns) => match crate::idmap::mount_idmapped(source, target, ns) {
            Ok(()) => true,
            // A file system that cannot be idmapped (procfs, older tmpfs)
            // is bound as it is: its files keep their node owners.
            Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                tracing::warn!(source = %source.display(), error = %e, "file system cannot be idmapped; bind-mounting it unmapped");
                false
            }
            Err(e) => return Err(io_err("idmapped mount of", source)(e)),
        },
        None => false,
    };
    if !idmapped {
        mount(
            Some(source),
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(nix_err("bind mount", target))?;
    }
    mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(nix_err("make private", target))?;
    if !readonly {
        return Ok(());
    }
    for m in mounts_under(target)? {
        mount(
            None::<&str>,
            &m.mount_point,
            None::<&str>,
            readonly_remount_flags(&m.mount_options),
            None::<&str>,
        )
        .map_err(nix_err("remount read-only", &m.mount_point))?;
    }
    // Never hand a tree on that is not read-only all the way down.
    if let Some(rw) = mounts_under(target)?
        .into_iter()
        .find(|m| !m.mount_options.split(',').any(|o| o == "ro"))
    {
        return Err(RuntimeError::FailedPrecondition(format!(
            "staged mount {} is still writable",
            rw.mount_point.display()
        )));
    }
    Ok(())
}

/// Unmounts and removes everything staged under `dir` (one container's).
/// Never deletes through a mount: entries are removed one by one, and only
/// once the table shows nothing mounted under `dir`. Returns how many staged
/// mounts were unmounted. Blocking.
pub(crate) fn remove_blocking(dir: &Path) -> Result<usize, RuntimeError> {
    if !dir.exists() {
        return Ok(0);
    }
    let mut removed = 0;
    // Deepest first; a detach takes the submounts of a tree with it.
    let mut points: Vec<PathBuf> = mounts_under(dir)?
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in &points {
        match umount2(p, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) => {
                if p.parent() == Some(dir) {
                    removed += 1;
                }
            }
            Err(Errno::EINVAL | Errno::ENOENT) => {}
            Err(e) => return Err(nix_err("unmount", p)(e)),
        }
    }
    if let Some(m) = mounts_under(dir)?.into_iter().next() {
        return Err(RuntimeError::FailedPrecondition(format!(
            "{} is still mounted",
            m.mount_point.display()
        )));
    }
    for entry in fs::read_dir(dir).map_err(io_err("read", dir))? {
        let path = entry.map_err(io_err("read", dir))?.path();
        let r = if path.is_dir() {
            fs::remove_dir(&path)
        } else {
            fs::remove_file(&path)
        };
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &path)(e)),
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(removed),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(removed),
        Err(e) => Err(io_err("remove", dir)(e)),
    }
}

/// Whether mount `m` needs staging for a container in the user namespace
/// at `userns` (if any).
pub(crate) fn needs_staging(m: &MountSpec, userns: Option<&Path>) -> bool {
    m.recursive_readonly || (m.idmapped && userns.is_some())
}

/// Stages every recursive read-only mount of `mounts`, and every idmapped
/// one of a container in the user namespace at `userns`, under `dir`, and
/// returns the mounts the runtime gets: those pointing at the staged trees
/// (private; read-only when asked) and the others unchanged. Nothing is
/// staged, and `dir` is not made, when no mount needs it. On failure what
/// was staged is removed again. Blocking.
pub(crate) fn stage_blocking(
    dir: &Path,
    mounts: &[MountSpec],
    userns: Option<&Path>,
) -> Result<Vec<MountSpec>, RuntimeError> {
    let mut out = Vec::with_capacity(mounts.len());
    for (i, m) in mounts.iter().enumerate() {
        if !needs_staging(m, userns) {
            out.push(m.clone());
            continue;
        }
        let target = dir.join(i.to_string());
        let ns = if m.idmapped { userns } else { None };
        if let Err(e) = stage_one(&m.host_path, &target, ns, m.recursive_readonly) {
            if let Err(undo) = remove_blocking(dir) {
                tracing::warn!(dir = %dir.display(), error = %undo, "removing a half-staged mount failed");
            }
            return Err(e);
        }
        out.push(MountSpec {
            host_path: target,
            readonly: m.readonly || m.recursive_readonly,
            recursive_readonly: false,
            idmapped: false,
            ..m.clone()
        });
    }
    Ok(out)
}

/// The user namespace a container runs in, as its OCI spec says: the path
/// it joins and the node ids its root maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpecUserns {
    /// `/proc/<infra>/ns/user` or the pod's pin.
    pub(crate) path: PathBuf,
    /// Node uid of the container's uid 0.
    pub(crate) root_uid: u32,
    /// Node gid of the container's gid 0.
    pub(crate) root_gid: u32,
}

/// The user namespace of the OCI spec `spec` (JSON), when it joins one by
/// path and maps container id 0.
pub(crate) fn spec_userns(spec: &[u8]) -> Option<SpecUserns> {
    let oci: oci_spec::runtime::Spec = serde_json::from_slice(spec).ok()?;
    let linux = oci.linux().as_ref()?;
    let path = linux
        .namespaces()
        .as_ref()?
        .iter()
        .find(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::User)?
        .path()
        .clone()?;
    let root = |maps: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>| {
        maps.as_ref()?
            .iter()
            .find(|m| m.container_id() == 0)
            .map(|m| m.host_id())
    };
    Some(SpecUserns {
        path,
        root_uid: root(linux.uid_mappings())?,
        root_gid: root(linux.gid_mappings())?,
    })
}

/// The rootfs mounts of a container in user namespace `userns`, made
/// usable by its root: every overlay lower layer is mounted idmapped
/// through the pod's user namespace under `dir` (`layer<n>`), so files
/// owned by node root are owned by the container's root, and the upper
/// layer's top directory, when still node root's, is given to the
/// container's root (as containerd does), so it may create files in `/`.
/// Mounts of other types pass unchanged. Blocking.
pub(crate) fn idmap_rootfs_blocking(
    dir: &Path,
    mounts: Vec<containerd_client::types::Mount>,
    userns: &SpecUserns,
) -> Result<Vec<containerd_client::types::Mount>, RuntimeError> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::with_capacity(mounts.len());
    let mut layer = 0usize;
    for mut m in mounts {
        if m.r#type != "overlay" {
            out.push(m);
            continue;
        }
        let mut options = Vec::with_capacity(m.options.len());
        for o in &m.options {
            if let Some(lowers) = o.strip_prefix("lowerdir=") {
                let mut mapped = Vec::new();
                for lower in lowers.split(':') {
                    let target = dir.join(format!("layer{layer}"));
                    layer += 1;
                    fs::create_dir_all(&target).map_err(io_err("create", &target))?;
                    crate::idmap::mount_idmapped(Path::new(lower), &target, &userns.path)
                        .map_err(io_err("idmapped mount of", Path::new(lower)))?;
                    mapped.push(target.display().to_string());
                }
                options.push(format!("lowerdir={}", mapped.join(":")));
            } else {
                if let Some(upper) = o.strip_prefix("upperdir=") {
                    let upper = Path::new(upper);
                    let md = fs::metadata(upper).map_err(io_err("stat", upper))?;
                    if md.uid() == 0 && md.gid() == 0 {
                        std::os::unix::fs::chown(
                            upper,
                            Some(userns.root_uid),
                            Some(userns.root_gid),
                        )
                        .map_err(io_err("chown", upper))?;
                    }
                }
                options.push(o.clone());
            }
        }
        m.options = options;
        out.push(m);
    }
    Ok(out)
}

/// The container ids that have something staged under `root`
/// (`<state_dir>/staged`).
pub(crate) fn staged_ids(root: &Path) -> Vec<String> {
    fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Propagation;

    #[test]
    fn remounts_keep_the_other_flags() {
        let f = readonly_remount_flags("rw,nosuid,nodev,noexec,relatime");
        assert!(f.contains(MsFlags::MS_RDONLY | MsFlags::MS_BIND | MsFlags::MS_REMOUNT));
        assert!(f.contains(MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC));
        assert!(f.contains(MsFlags::MS_RELATIME));
        assert!(!readonly_remount_flags("rw").contains(MsFlags::MS_NOSUID));
    }

    /// Runs `f` on a thread with a private mount namespace of its own, so
    /// nothing it mounts is seen on the node. Skipped without root.
    fn in_own_mount_ns(f: impl FnOnce() + Send + 'static) {
        if cubelet_testkit::is_root("this test (mount namespaces)") {
            cubelet_testkit::on_private_thread(cubelet_testkit::Namespaces::Mount, f);
        }
    }

    #[test]
    fn staged_trees_are_read_only_at_every_level_and_go_away_whole() {
        in_own_mount_ns(|| {
            let work = tempfile::tempdir().unwrap();
            let src = work.path().join("src");
            let sub = src.join("tmpfs");
            fs::create_dir_all(&sub).unwrap();
            mount(
                Some("none"),
                &sub,
                Some("tmpfs"),
                MsFlags::MS_NOSUID,
                None::<&str>,
            )
            .unwrap();
            fs::write(src.join("file"), b"x").unwrap();
            let staged_root = work.path().join("staged").join("c1");
            let mounts = vec![
                MountSpec {
                    host_path: src.clone(),
                    container_path: "/mnt".into(),
                    readonly: true,
                    propagation: Propagation::Private,
                    recursive_readonly: true,
                    idmapped: false,
                },
                MountSpec {
                    host_path: src.clone(),
                    container_path: "/plain".into(),
                    readonly: true,
                    ..Default::default()
                },
            ];
            let out = stage_blocking(&staged_root, &mounts, None).unwrap();
            assert_eq!(out[0].host_path, staged_root.join("0"));
            assert!(!out[0].recursive_readonly && out[0].readonly);
            assert_eq!(out[1], mounts[1], "other mounts are left alone");
            let staged = &out[0].host_path;
            for path in [staged.join("new"), staged.join("tmpfs").join("new")] {
                let e = fs::write(&path, b"y").unwrap_err();
                assert_eq!(
                    e.raw_os_error(),
                    Some(Errno::EROFS as i32),
                    "{}",
                    path.display()
                );
            }
            assert_eq!(fs::read(staged.join("file")).unwrap(), b"x");
            let sub_opts = mounts_under(&staged.join("tmpfs")).unwrap();
            assert!(sub_opts[0].mount_options.contains("nosuid"), "{sub_opts:?}");
            // The source itself stays writable.
            fs::write(sub.join("new"), b"z").unwrap();
            assert_eq!(
                staged_ids(&work.path().join("staged")),
                vec!["c1".to_owned()]
            );

            assert_eq!(remove_blocking(&staged_root).unwrap(), 1);
            assert!(!staged_root.exists());
            assert!(mounts_under(&work.path().join("staged"))
                .unwrap()
                .is_empty());
            assert_eq!(
                fs::read(sub.join("new")).unwrap(),
                b"z",
                "nothing deleted through"
            );
            assert_eq!(remove_blocking(&staged_root).unwrap(), 0, "idempotent");
            umount2(&sub, MntFlags::MNT_DETACH).unwrap();
        });
    }

    #[test]
    fn a_file_can_be_staged_too() {
        in_own_mount_ns(|| {
            let work = tempfile::tempdir().unwrap();
            let src = work.path().join("hosts");
            fs::write(&src, b"127.0.0.1 localhost\n").unwrap();
            let root = work.path().join("staged").join("c2");
            let out = stage_blocking(
                &root,
                &[MountSpec {
                    host_path: src.clone(),
                    container_path: "/etc/hosts".into(),
                    readonly: true,
                    recursive_readonly: true,
                    ..Default::default()
                }],
                None,
            )
            .unwrap();
            let e = fs::write(&out[0].host_path, b"y").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(Errno::EROFS as i32));
            assert_eq!(remove_blocking(&root).unwrap(), 1);
            assert!(!root.exists());
            assert_eq!(fs::read(&src).unwrap(), b"127.0.0.1 localhost\n");
        });
    }
}
