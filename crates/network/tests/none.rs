//! Black-box tests of the `none` provider. Each runs in its own network and
//! mount namespace (see `common`), so the host is never touched.

mod common;

use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use common::*;
use cubelet_engine::spec::{NetworkStatus, PortMapping, Protocol, SandboxSpec};
use cubelet_engine::{Flow, StepErrorKind};
use cubelet_network::{NoneGcReport, NoneNetwork};

fn provider(env: &Env) -> Arc<NoneNetwork> {
    Arc::new(NoneNetwork::new(env.state_dir.clone()).expect("absolute state dir"))
}

/// Link names in the namespace pinned at `pin` (the caller's when `None`).
fn links(pin: Option<&Path>) -> Result<Vec<String>> {
    let out = match pin {
        Some(p) => {
            let net = format!("--net={}", p.display());
            run(&["nsenter", &net, "ip", "-o", "link", "show"])?
        }
        None => run(&["ip", "-o", "link", "show"])?,
    };
    Ok(out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .collect())
}

/// The namespace inode behind a pin (or `/proc/thread-self/ns/net`).
fn ns_inode(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)?.ino())
}

/// Nothing of any sandbox is left: no pins, no nsfs mounts.
fn assert_no_pins(env: &Env) {
    assert_eq!(pins(env), Vec::<String>::new(), "netns pins left");
    assert_eq!(ns_mounts(&env.state_dir), 0, "nsfs mounts left");
}

#[test]
fn pods_get_a_pinned_loopback_only_namespace_and_no_address() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        net.init().await?;
        let host_links = links(None)?;
        let spec = SandboxSpec {
            port_mappings: vec![PortMapping {
                protocol: Protocol::Tcp,
                container_port: 80,
                host_port: 18090,
                host_ip: None,
            }],
            ..Default::default()
        };
        let ids: Vec<_> = (0..3).map(sid).collect();
        let mut inodes = std::collections::HashSet::new();
        inodes.insert(ns_inode(Path::new("/proc/thread-self/ns/net"))?);
        for (n, id) in ids.iter().enumerate() {
            let spec = if n == 0 {
                spec.clone()
            } else {
                SandboxSpec::default()
            };
            let c = ctx(id, spec);
            net.create(&c).await?;
            let status: NetworkStatus = c.get().expect("status published");
            assert_eq!(
                status,
                NetworkStatus {
                    netns_path: Some(net.netns_path(id)),
                    ips: Vec::new(),
                    interface: None,
                    userns_path: None,
                }
            );
            assert_eq!(
                net.netns_path(id),
                env.state_dir.join("netns").join(id.as_str())
            );
            let pin = net.netns_path(id);
            assert!(inodes.insert(ns_inode(&pin)?), "a namespace of its own");

            // Inside: lo only, up, with its loopback address; no route out.
            assert_eq!(links(Some(&pin))?, vec!["lo".to_owned()]);
            let nsarg = format!("--net={}", pin.display());
            let lo = run(&["nsenter", &nsarg, "ip", "-o", "link", "show", "lo"])?;
            assert!(lo.contains(",UP"), "{lo}");
            let addr = run(&["nsenter", &nsarg, "ip", "-o", "-4", "addr", "show"])?;
            assert!(addr.contains("127.0.0.1/8"), "{addr}");
            assert_eq!(addr.lines().count(), 1, "{addr}");
            let routes = run(&["nsenter", &nsarg, "ip", "-4", "route", "show"])?;
            assert_eq!(routes.trim(), "", "no routes");
        }
        assert_eq!(pins(&env).len(), 3);
        assert_eq!(ns_mounts(&env.state_dir), 3);
        // The node is untouched: no links, and the port mapping made no rules.
        assert_eq!(links(None)?, host_links);
        let rules = run(&["nft", "list", "ruleset"])?;
        assert_eq!(rules.trim(), "", "{rules}");

        for id in &ids {
            net.destroy(&ctx(id, SandboxSpec::default())).await?;
        }
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn destroy_and_cleanup_are_idempotent_and_accept_unknown_sandboxes() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        let never = sid(1000);
        net.destroy(&ctx(&never, SandboxSpec::default())).await?;
        net.cleanup(&ctx(&never, SandboxSpec::default())).await?;

        // StopPodSandbox then RemovePodSandbox: the pin goes at destroy.
        let id = sid(1);
        let c = ctx(&id, SandboxSpec::default());
        net.create(&c).await?;
        net.destroy(&c).await?;
        assert_no_pins(&env);
        net.destroy(&c).await?;
        net.cleanup(&c).await?;
        net.cleanup(&c).await?;
        assert_no_pins(&env);

        // RemovePodSandbox of a pod never stopped: cleanup removes it too.
        let other = sid(2);
        let c = ctx(&other, SandboxSpec::default());
        net.create(&c).await?;
        net.cleanup(&c).await?;
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn create_is_idempotent_and_concurrent_creates_do_not_collide() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        let id = sid(1);
        let c = ctx(&id, SandboxSpec::default());
        net.create(&c).await?;
        let first: NetworkStatus = c.get().expect("first");
        let inode = ns_inode(&net.netns_path(&id))?;
        net.create(&c).await?;
        let second: NetworkStatus = c.get().expect("second");
        assert_eq!(first, second, "a repeated create returns the same network");
        assert_eq!(ns_inode(&net.netns_path(&id))?, inode, "same namespace");
        assert_eq!(pins(&env).len(), 1);
        net.destroy(&c).await?;

        let ids: Vec<_> = (100..120).map(sid).collect();
        let ctxs: Vec<_> = ids.iter().map(|i| ctx(i, SandboxSpec::default())).collect();
        for r in futures::future::join_all(ctxs.iter().map(|c| net.create(c))).await {
            r?;
        }
        assert_eq!(pins(&env).len(), 20);
        let inodes: std::collections::HashSet<_> = ids
            .iter()
            .map(|i| ns_inode(&net.netns_path(i)))
            .collect::<Result<_>>()?;
        assert_eq!(inodes.len(), 20, "twenty distinct namespaces");
        for r in futures::future::join_all(ctxs.iter().map(|c| net.destroy(c))).await {
            r?;
        }
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn host_network_pods_get_no_namespace() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        fake_uplink()?;
        let id = sid(1);
        let c = ctx(&id, host_network_spec());
        net.create(&c).await?;
        let status: NetworkStatus = c.get().expect("status");
        assert_eq!(status.netns_path, None::<PathBuf>);
        assert_eq!(status.interface, None);
        assert_eq!(
            status.ips,
            vec![IpAddr::V4(UPLINK_IP)],
            "the node's address, as with the other providers"
        );
        assert!(pins(&env).is_empty());
        net.destroy(&c).await?;
        net.cleanup(&c).await?;
        run(&["ip", "link", "del", "tup0"])?;
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn gc_removes_pins_no_live_sandbox_owns() {
    isolated(|env| async move {
        let net = provider(&env);
        // Before init: no pin directory, nothing to do.
        assert_eq!(net.gc(&live(&[])).await?, NoneGcReport::default());
        net.init().await?;
        let ids: Vec<_> = (0..3).map(sid).collect();
        for id in &ids {
            net.create(&ctx(id, SandboxSpec::default())).await?;
        }
        // A file whose name is not in Cubelet's id format: not Cubelet's,
        // left alone.
        let stray = env.state_dir.join("netns").join("Not-An-Id");
        std::fs::write(&stray, b"")?;

        let report = net.gc(&live(&[&ids[0]])).await?;
        assert_eq!(report, NoneGcReport { netns: 2 });
        assert!(stray.exists(), "a foreign file was removed");
        std::fs::remove_file(&stray)?;
        assert_eq!(pins(&env), vec![ids[0].to_string()]);
        assert_eq!(ns_mounts(&env.state_dir), 1);

        let again = net.gc(&live(&[&ids[0]])).await?;
        assert_eq!(again, NoneGcReport::default());
        net.destroy(&ctx(&ids[0], SandboxSpec::default())).await?;
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn cancelled_create_builds_nothing() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        let id = sid(1);
        let token = tokio_util::sync::CancellationToken::new();
        token.cancel();
        let c = ctx(&id, SandboxSpec::default()).with_cancel(token);
        let err = net.create(&c).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::Cancelled, "{err}");
        assert!(c.get::<NetworkStatus>().is_none(), "nothing published");
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn interface_counters_are_read_inside_a_pinned_namespace() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        let id = sid(7);
        let c = ctx(&id, SandboxSpec::default());
        net.create(&c).await?;
        let pin = net.netns_path(&id);
        let nsarg = format!("--net={}", pin.display());
        run(&[
            "nsenter", &nsarg, "ip", "link", "add", "tv7a", "type", "veth", "peer", "name", "tv7b",
        ])?;
        let inside = cubelet_network::net_dev_in_netns(pin.clone()).await?;
        assert!(inside.contains("tv7a:"), "{inside}");
        assert!(inside.contains("lo:"), "{inside}");
        // The caller's namespace is not the pod's, and is left as it was.
        let here = std::fs::read_to_string("/proc/thread-self/net/dev")?;
        assert!(!here.contains("tv7a:"), "{here}");
        let e = cubelet_network::net_dev_in_netns(env.state_dir.join("nope"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        net.destroy(&c).await?;
        assert_no_pins(&env);
        Ok(())
    });
}

#[test]
fn a_dropped_create_leaves_no_pin_after_its_teardown() {
    isolated(|env| async move {
        let net = provider(&env);
        net.init().await?;
        let mut dropped = 0;
        for n in 0..20 {
            let id = sid(100 + n);
            // One poll: the namespace thread is started, then the create is
            // dropped (a flow cut short) while that thread goes on; a thread
            // fast enough finishes within the poll.
            let once = std::time::Duration::ZERO;
            let create = tokio::time::timeout(once, net.create_sandbox(&id, false, &[])).await;
            dropped += usize::from(create.is_err());
            net.teardown(&id).await?;
            // Give a thread that was not waited for the time to pin.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            assert_no_pins(&env);
        }
        eprintln!("{dropped} of 20 creates dropped while their thread ran");
        Ok(())
    });
}
