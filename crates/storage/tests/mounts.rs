//! Root tests: shm mounts, teardown, GC and refusal of bad input, each in a
//! private mount namespace with a temp root.

mod common;

use std::fs;
use std::path::PathBuf;

use common::*;
use cubelet_engine::spec::StorageStatus;
use cubelet_engine::{Flow, StepErrorKind};
use cubelet_storage::{is_mounted, mount_table, validate_log_directory};
use nix::mount::{mount, MsFlags};

const MIB: u64 = 1 << 20;

#[test]
fn shm_is_mounted_with_size_and_flags() {
    if !need_root("shm_is_mounted_with_size_and_flags") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(8 * MIB);
        let sid = id("aaaa1111");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.init().await.unwrap();
        fx.storage.create(&ctx).await.unwrap();
        let st: StorageStatus = ctx.get().unwrap();
        let shm = st.shm_path.clone().unwrap();

        let table = mount_table().unwrap();
        let canon_shm = fs::canonicalize(&shm).unwrap();
        let m = table
            .iter()
            .find(|m| m.mount_point == canon_shm)
            .expect("shm in mountinfo");
        assert_eq!(m.fstype, "tmpfs");
        assert!(
            m.super_options.split(',').any(|o| o == "size=8192k"),
            "{}",
            m.super_options
        );
        // tmpfs lists `mode=` only when it differs from 1777, so stat the root.
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&shm).unwrap().permissions().mode() & 0o7777,
            0o1777
        );
        for flag in ["nosuid", "nodev", "noexec"] {
            assert!(
                m.mount_options.split(',').any(|o| o == flag),
                "{flag} in {}",
                m.mount_options
            );
        }
        let sfs = nix::sys::statfs::statfs(&shm).unwrap();
        #[allow(clippy::useless_conversion)]
        let bytes = u64::try_from(sfs.blocks()).unwrap() * u64::try_from(sfs.block_size()).unwrap();
        assert_eq!(bytes, 8 * MIB);

        // Creating again does not stack a second tmpfs.
        fx.storage.create(&ctx).await.unwrap();
        let count = mount_table()
            .unwrap()
            .iter()
            .filter(|m| m.mount_point == canon_shm)
            .count();
        assert_eq!(count, 1);

        fx.storage.cleanup(&ctx).await.unwrap();
        assert!(fx.mounts_under_tmp().is_empty());
        assert!(!st.sandbox_dir.exists());
    });
}

#[test]
fn destroy_unmounts_and_keeps_files_then_cleanup_removes_all() {
    if !need_root("destroy_unmounts_and_keeps_files_then_cleanup_removes_all") {
        return;
    }
    let tmp_path = in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let sid = id("bbbb2222");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.create(&ctx).await.unwrap();
        let st: StorageStatus = ctx.get().unwrap();
        let shm = st.shm_path.clone().unwrap();
        fs::write(shm.join("segment"), b"data").unwrap();
        assert!(is_mounted(&shm).unwrap());

        fx.storage.destroy(&ctx).await.unwrap();
        assert!(!is_mounted(&shm).unwrap());
        assert!(
            !shm.join("segment").exists(),
            "the tmpfs content went with the mount"
        );
        assert!(
            st.hosts_path.is_file() && st.hostname_path.is_file() && st.resolv_conf_path.is_file()
        );
        fx.storage.destroy(&ctx).await.unwrap();

        fx.storage.cleanup(&ctx).await.unwrap();
        fx.storage.cleanup(&ctx).await.unwrap();
        assert_eq!(tree(&fx.root()), vec![PathBuf::from("sandboxes")]);
        assert!(fx.mounts_under_tmp().is_empty());
        fx.tmp.path().to_path_buf()
    });
    assert!(!tmp_path.exists(), "temp root removed");
}

#[test]
fn a_shell_has_the_pods_files_ready_and_a_claim_rewrites_them_in_place() {
    if !need_root("a_shell_has_the_pods_files_ready_and_a_claim_rewrites_them_in_place") {
        return;
    }
    in_private_ns(|| async {
        use std::os::unix::fs::MetadataExt;
        let fx = Fixture::new(4 * MIB);
        let sid = id("cccc3333");
        let shell = fx.storage.prepare_shell(&sid).await.unwrap();
        let files = [
            shell.hostname_path.clone(),
            shell.hosts_path.clone(),
            shell.resolv_conf_path.clone(),
        ];
        let inodes: Vec<u64> = files
            .iter()
            .map(|f| {
                let m = fs::metadata(f).unwrap();
                assert_eq!(m.len(), 0, "{} is empty in a shell", f.display());
                m.ino()
            })
            .collect();
        let spec = pod_spec();
        let st = fx
            .storage
            .finish_shell(&sid, &spec, &["10.86.0.7".parse().unwrap()], shell)
            .await
            .unwrap();
        for (f, ino) in files.iter().zip(&inodes) {
            assert_eq!(fs::metadata(f).unwrap().ino(), *ino, "{}", f.display());
        }
        assert_eq!(
            fs::read_to_string(&st.hostname_path).unwrap(),
            format!("{}\n", spec.effective_hostname())
        );
        assert!(fs::read_to_string(&st.hosts_path)
            .unwrap()
            .ends_with(&format!("10.86.0.7\t{}\n", spec.effective_hostname())));
        fx.storage.destroy_sandbox(&sid).unwrap();
        fx.storage.cleanup_sandbox(&sid).unwrap();
        assert_eq!(tree(&fx.root()), vec![PathBuf::from("sandboxes")]);
        assert!(fx.mounts_under_tmp().is_empty());
    });
}

#[test]
fn cleanup_without_destroy_unmounts_first() {
    if !need_root("cleanup_without_destroy_unmounts_first") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let sid = id("cccc3333");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.create(&ctx).await.unwrap();
        // A second tmpfs stacked by hand is unmounted as well.
        let shm = fx.storage.paths(&sid).shm;
        mount(
            Some("shm"),
            &shm,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        fx.storage.cleanup(&ctx).await.unwrap();
        assert!(fx.mounts_under_tmp().is_empty());
        assert_eq!(tree(&fx.root()), vec![PathBuf::from("sandboxes")]);
    });
}

#[test]
fn cleanup_refuses_foreign_mount_inside_sandbox_dir() {
    if !need_root("cleanup_refuses_foreign_mount_inside_sandbox_dir") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let sid = id("cccc4444");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.create(&ctx).await.unwrap();
        // Something else bind-mounted a directory into the sandbox dir:
        // cleanup must not delete through it.
        let outside = fx.tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "x").unwrap();
        let inside = fx.storage.paths(&sid).dir.join("foreign");
        fs::create_dir(&inside).unwrap();
        mount(
            Some(&outside),
            &inside,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap();

        let err = fx.storage.cleanup(&ctx).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::FailedPrecondition, "{err}");
        assert_eq!(fs::read_to_string(outside.join("precious")).unwrap(), "x");

        cubelet_storage::unmount_all(&inside).unwrap();
        fx.storage.cleanup(&ctx).await.unwrap();
        assert_eq!(fs::read_to_string(outside.join("precious")).unwrap(), "x");
        assert!(fx.mounts_under_tmp().is_empty());
    });
}

#[test]
fn gc_reclaims_orphans_only() {
    if !need_root("gc_reclaims_orphans_only") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let alive = id("1111aaaa");
        let orphan_dir = id("2222bbbb");
        let orphan_mount = id("3333cccc");
        let alive_ctx = ctx(&alive, pod_spec());
        fx.storage.create(&alive_ctx).await.unwrap();

        // Seed an orphan directory (with a destroyed sandbox's files) ...
        let o = fx.storage.paths(&orphan_dir);
        fs::create_dir_all(&o.shm).unwrap();
        fs::write(&o.hosts, "x").unwrap();
        // ... an orphan tmpfs mount ...
        let m = fx.storage.paths(&orphan_mount);
        fs::create_dir_all(&m.shm).unwrap();
        mount(
            Some("shm"),
            &m.shm,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        // ... and things gc must leave alone: a non-id entry and a symlink out.
        let sandboxes = fx.root().join("sandboxes");
        fs::write(sandboxes.join("NOT-AN-ID"), "keep").unwrap();
        let outside = fx.tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, sandboxes.join("4444dddd")).unwrap();

        let report = fx.storage.gc(&live(&[&alive])).unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.dirs, 2);
        assert_eq!(report.mounts, 1);
        assert!(!o.dir.exists() && !m.dir.exists());
        assert!(
            is_mounted(&fx.storage.paths(&alive).shm).unwrap(),
            "live sandbox untouched"
        );
        assert_eq!(fs::read_to_string(outside.join("precious")).unwrap(), "x");
        assert!(sandboxes.join("NOT-AN-ID").is_file());

        // A second pass finds nothing.
        let again = fx.storage.gc(&live(&[&alive])).unwrap();
        assert_eq!((again.dirs, again.mounts), (0, 0));

        fx.storage.cleanup(&alive_ctx).await.unwrap();
        let all = fx.storage.gc(&live(&[])).unwrap();
        assert_eq!((all.dirs, all.mounts), (0, 0));
        assert!(fx.mounts_under_tmp().is_empty());
        let mut left = tree(&sandboxes);
        left.sort();
        assert_eq!(
            left,
            vec![PathBuf::from("4444dddd"), PathBuf::from("NOT-AN-ID")]
        );
    });
}

#[test]
fn bad_log_directory_touches_nothing() {
    if !need_root("bad_log_directory_touches_nothing") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let before = mount_table().unwrap();
        let escape = fx.tmp.path().join("logs/../escaped");
        for bad in [
            PathBuf::from("logs/relative"),
            escape.clone(),
            PathBuf::from("/a/../b"),
        ] {
            assert!(validate_log_directory(&bad).is_err());
            let mut spec = pod_spec();
            spec.log_directory = Some(bad.clone());
            let ctx = ctx(&id("5555eeee"), spec);
            let err = fx.storage.create(&ctx).await.unwrap_err();
            assert_eq!(err.kind(), StepErrorKind::InvalidArgument);
            assert!(err.to_string().contains("log_directory"), "{err}");
            assert!(ctx.get::<StorageStatus>().is_none());
        }
        assert_eq!(mount_table().unwrap(), before);
        assert_eq!(tree(fx.tmp.path()), vec![PathBuf::from("host-resolv.conf")]);
        assert!(!fx.tmp.path().join("escaped").exists());
    });
}

#[test]
fn log_directory_is_created_and_never_removed() {
    if !need_root("log_directory_is_created_and_never_removed") {
        return;
    }
    in_private_ns(|| async {
        let fx = Fixture::new(4 * MIB);
        let logs = fx.tmp.path().join("pods/default_web-0_uid-1");
        let mut spec = pod_spec();
        spec.log_directory = Some(logs.clone());
        let sid = id("6666ffff");
        let ctx = ctx(&sid, spec);
        fx.storage.create(&ctx).await.unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&logs).unwrap().permissions().mode() & 0o7777,
            0o755
        );
        fx.storage.destroy(&ctx).await.unwrap();
        fx.storage.cleanup(&ctx).await.unwrap();
        fx.storage.gc(&live(&[])).unwrap();
        assert!(logs.is_dir());
        assert!(fx.mounts_under_tmp().is_empty());
    });
}
