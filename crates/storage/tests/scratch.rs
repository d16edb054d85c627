//! Root tests of scratch space: the pre-formatted image pool, loop mounts
//! and their teardown, each in a private mount namespace with a temp root.
//! Needs `mkfs.ext4`, `mount` with loop support and free loop devices.

mod common;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cubelet_engine::spec::StorageStatus;
use cubelet_engine::Flow;
use cubelet_storage::{is_mounted, mount_table, LocalStorage, ScratchConfig, StorageConfig};

const MIB: u64 = 1 << 20;

fn scratch_fixture(pool_size: usize, image_size: u64) -> Fixture {
    let tmp = tempfile::Builder::new()
        .prefix("cubelet-storage-test-")
        .tempdir()
        .expect("tempdir");
    let host = tmp.path().join("host-resolv.conf");
    fs::write(&host, "nameserver 192.0.2.53\n").expect("write");
    let root = tmp.path().join("root");
    let mut cfg = StorageConfig::new(&root);
    cfg.shm_size = 4 * MIB;
    cfg.host_resolv_conf = host;
    cfg.scratch = Some(ScratchConfig {
        pool_dir: root.join("scratch-pool"),
        pool_size,
        image_size,
    });
    Fixture::with_config(tmp, cfg)
}

fn have_tools(test: &str) -> bool {
    if !need_root(test) {
        return false;
    }
    let ok = Path::new("/dev/loop-control").exists()
        && std::process::Command::new("mkfs.ext4")
            .arg("-V")
            .output()
            .is_ok();
    if !ok {
        eprintln!("SKIPPED {test}: needs /dev/loop-control and mkfs.ext4");
    }
    ok
}

/// Waits (up to a generous deadline, not a timing assertion) until the
/// pool holds `n` ready images.
async fn wait_ready(s: &LocalStorage, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while s.pool_stats().expect("scratch on").ready < n {
        assert!(
            Instant::now() < deadline,
            "pool never reached {n} images: {:?}",
            s.pool_stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until no loop device is backed by a file under `dir` (auto-clear
/// runs when the last user of a lazily detached mount goes away).
async fn wait_no_loops(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !loops_under(dir).is_empty() {
        assert!(
            Instant::now() < deadline,
            "loop devices left: {:?}",
            loops_under(dir)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn scratch_from_pool_is_mounted_and_torn_down() {
    if !have_tools("scratch_from_pool_is_mounted_and_torn_down") {
        return;
    }
    in_private_ns(|| async {
        let fx = scratch_fixture(2, 32 * MIB);
        fx.storage.init().await.unwrap();
        wait_ready(&fx.storage, 2).await;

        let sid = id("5c7a7c40");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.create(&ctx).await.unwrap();
        let stats = fx.storage.pool_stats().unwrap();
        assert_eq!((stats.hits, stats.misses), (1, 0));

        let st: StorageStatus = ctx.get().unwrap();
        let scratch = st.scratch_path.clone().expect("scratch published");
        let canon = fs::canonicalize(&scratch).unwrap();
        let table = mount_table().unwrap();
        let m = table
            .iter()
            .find(|m| m.mount_point == canon)
            .expect("scratch mounted");
        assert_eq!(m.fstype, "ext4");
        assert!(m.source.starts_with("/dev/loop"), "{}", m.source);
        for flag in ["nosuid", "nodev"] {
            assert!(
                m.mount_options.split(',').any(|o| o == flag),
                "{}",
                m.mount_options
            );
        }
        let sfs = nix::sys::statfs::statfs(&scratch).unwrap();
        #[allow(clippy::useless_conversion)]
        let bytes = u64::try_from(sfs.blocks()).unwrap() * u64::try_from(sfs.block_size()).unwrap();
        assert!(
            bytes <= 32 * MIB && bytes > 16 * MIB,
            "scratch size {bytes}"
        );
        fs::write(scratch.join("data"), b"scratch").unwrap();
        assert_eq!(loops_under(fx.tmp.path()).len(), 1);

        // Create again is idempotent: no second loop mount.
        fx.storage.create(&ctx).await.unwrap();
        assert_eq!(
            mount_table()
                .unwrap()
                .iter()
                .filter(|m| m.mount_point == canon)
                .count(),
            1
        );

        fx.storage.destroy(&ctx).await.unwrap();
        assert!(!is_mounted(&scratch).unwrap());
        assert!(!is_mounted(st.shm_path.as_ref().unwrap()).unwrap());
        wait_no_loops(fx.tmp.path()).await;
        fx.storage.cleanup(&ctx).await.unwrap();
        assert!(!st.sandbox_dir.exists());

        // Let the refill finish so no mkfs runs while the fixture is removed.
        wait_ready(&fx.storage, 2).await;
        assert!(fx.mounts_under_tmp().is_empty());
    });
}

#[test]
fn empty_pool_formats_inline_and_counts_a_miss() {
    if !have_tools("empty_pool_formats_inline_and_counts_a_miss") {
        return;
    }
    in_private_ns(|| async {
        let fx = scratch_fixture(0, 16 * MIB);
        fx.storage.init().await.unwrap();
        let sid = id("5c7a7c41");
        let ctx = ctx(&sid, pod_spec());
        fx.storage.create(&ctx).await.unwrap();
        let stats = fx.storage.pool_stats().unwrap();
        assert_eq!((stats.hits, stats.misses, stats.capacity), (0, 1, 0));
        assert!(is_mounted(&fx.storage.paths(&sid).scratch).unwrap());
        fx.storage.cleanup(&ctx).await.unwrap();
        wait_no_loops(fx.tmp.path()).await;
        assert!(fx.mounts_under_tmp().is_empty());
    });
}

#[test]
fn pool_images_survive_a_restart_and_gc_reclaims_scratch() {
    if !have_tools("pool_images_survive_a_restart_and_gc_reclaims_scratch") {
        return;
    }
    in_private_ns(|| async {
        let fx = scratch_fixture(1, 16 * MIB);
        fx.storage.init().await.unwrap();
        wait_ready(&fx.storage, 1).await;
        let sid = id("5c7a7c42");
        fx.storage.create(&ctx(&sid, pod_spec())).await.unwrap();
        wait_ready(&fx.storage, 1).await;

        // A new provider over the same root (a restart) adopts the ready image.
        let cfg = fx.storage.config().clone();
        let restarted = LocalStorage::new(cfg);
        restarted.init().await.unwrap();
        assert_eq!(restarted.pool_stats().unwrap().ready, 1);

        // The old sandbox is no longer live: gc unmounts shm and scratch
        // and removes its directory.
        let report = restarted.gc(&live(&[])).unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!((report.dirs, report.mounts), (1, 2));
        wait_no_loops(fx.tmp.path()).await;
        assert!(fx.mounts_under_tmp().is_empty());
        drop(restarted);
    });
}

/// Prints create latency with a warm pool (hit) and with an empty one
/// (cold: mkfs inline). Run with
/// `cargo test -p cubelet-storage --test scratch -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: prints figures"]
fn bench_scratch_hit_vs_cold() {
    if !have_tools("bench_scratch_hit_vs_cold") {
        return;
    }
    const N: usize = 10;
    const SIZE: u64 = 256 * MIB;
    in_private_ns(|| async {
        let mut report = Vec::new();
        for (label, pool) in [("pool hit", 2usize), ("cold (mkfs inline)", 0)] {
            let fx = scratch_fixture(pool, SIZE);
            fx.storage.init().await.unwrap();
            let mut times = Vec::new();
            for i in 0..N {
                if pool > 0 {
                    wait_ready(&fx.storage, pool).await;
                }
                let sid = id(&format!("be0c{i:04}"));
                let c = ctx(&sid, pod_spec());
                let t = Instant::now();
                fx.storage.create(&c).await.unwrap();
                times.push(t.elapsed());
                fx.storage.cleanup(&c).await.unwrap();
            }
            if pool > 0 {
                wait_ready(&fx.storage, pool).await;
            }
            wait_no_loops(fx.tmp.path()).await;
            times.sort();
            let stats = fx.storage.pool_stats().unwrap();
            report.push(format!(
                "{label:>20}: n={N} image={}MiB min={:?} p50={:?} max={:?} (hits={} misses={})",
                SIZE / MIB,
                times[0],
                times[N / 2],
                times[N - 1],
                stats.hits,
                stats.misses
            ));
        }
        for line in report {
            println!("{line}");
        }
    });
}
