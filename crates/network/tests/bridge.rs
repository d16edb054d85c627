//! Black-box tests of the bridge provider. Each runs in its own network and
//! mount namespace (see `common`), so the host is never touched.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;

use anyhow::Result;
use common::*;
use cubelet_engine::spec::{NetworkStatus, PortMapping, Protocol, SandboxSpec};
use cubelet_engine::{Flow, StepErrorKind};
use cubelet_network::{veth_name, NetworkError, SubStep};

fn v4(status: &NetworkStatus) -> Ipv4Addr {
    match status.ips.first() {
        Some(IpAddr::V4(ip)) => *ip,
        other => panic!("no IPv4 in {other:?}"),
    }
}

#[test]
fn init_is_idempotent_and_sets_up_the_node() {
    isolated(|env| async move {
        let (net, _) = provider(&env, "10.77.0.0/24");
        net.init().await?;
        net.init().await?;
        let addr = run(&["ip", "-o", "-4", "addr", "show", "dev", BRIDGE])?;
        assert!(addr.contains("10.77.0.1/24"), "{addr}");
        assert!(run(&["ip", "-o", "link", "show", BRIDGE])?.contains("mtu 1400"));
        assert_eq!(
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")?.trim(),
            "1"
        );
        let rules = run(&["nft", "list", "table", "ip", net.nft_table()])?;
        assert_eq!(
            rules.matches("masquerade").count(),
            3,
            "no duplicate rules on re-init:\n{rules}"
        );
        assert!(
            rules.contains("ip saddr 127.0.0.0/8 ct status dnat masquerade"),
            "{rules}"
        );
        assert_eq!(
            rules
                .matches("iifname != \"lo\" ip daddr 127.0.0.0/8 drop")
                .count(),
            1,
            "one loopback guard, before DNAT:\n{rules}"
        );
        assert!(
            rules.contains("ip saddr 10.77.0.0/24 ip daddr != 10.77.0.0/24 masquerade"),
            "{rules}"
        );
        // The bridge keeps its hardware address as ports join and leave
        // (else pods lose the gateway from their ARP cache).
        let mac = || -> Result<String> {
            let link = run(&["ip", "-o", "link", "show", BRIDGE])?;
            Ok(link
                .split_whitespace()
                .skip_while(|w| *w != "link/ether")
                .nth(1)
                .unwrap_or_default()
                .to_owned())
        };
        let before = mac()?;
        let ids: Vec<_> = (0..4).map(sid).collect();
        for id in &ids {
            net.create_sandbox(id, false, &[]).await?;
            assert_eq!(mac()?, before, "bridge address moved with a port");
        }
        for id in &ids {
            net.teardown(id, false).await?;
        }
        assert_eq!(mac()?, before);
        Ok(())
    });
}

/// `accept_dad` and `router_solicitations` of the test's own `eth0`.
fn host_eth0_v6() -> Result<Vec<String>> {
    ["accept_dad", "router_solicitations"]
        .iter()
        .map(|key| {
            Ok(std::fs::read_to_string(format!(
                "/proc/sys/net/ipv6/conf/eth0/{key}"
            ))?)
        })
        .collect()
}

#[test]
fn create_and_destroy_fifty_sandboxes_leaves_nothing() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.78.0.0/24");
        net.init().await?;
        // An eth0 of the test's own (its "host" namespace has none) whose
        // IPv6 settings a write meant for a pod's namespace would change.
        run(&["ip", "link", "add", "eth0", "type", "bridge"])?;
        let host_before = host_eth0_v6()?;
        let ids: Vec<_> = (0..50).map(sid).collect();
        let mut ips = std::collections::HashSet::new();
        for id in &ids {
            let c = ctx(id, SandboxSpec::default());
            net.create(&c).await?;
            let status: NetworkStatus = c.get().expect("status published");
            assert_eq!(status.netns_path, Some(net.netns_path(id)));
            assert_eq!(status.interface.as_deref(), Some("eth0"));
            assert!(ips.insert(v4(&status)), "duplicate address");
        }
        assert_eq!(pins(&env).len(), 50);
        assert_eq!(veths()?.len(), 50);
        assert_eq!(leases.len(), 50);

        // Inside one sandbox: eth0 with its address and MTU, default route via the gateway.
        let pin = net.netns_path(&ids[0]);
        let nsarg = format!("--net={}", pin.display());
        let addr = run(&[
            "nsenter", &nsarg, "ip", "-o", "-4", "addr", "show", "dev", "eth0",
        ])?;
        assert!(addr.contains("10.78.0.") && addr.contains("/24"), "{addr}");
        assert!(run(&["nsenter", &nsarg, "ip", "link", "show", "eth0"])?.contains("mtu 1400"));
        let route = run(&["nsenter", &nsarg, "ip", "-4", "route", "show", "default"])?;
        assert!(route.contains("via 10.78.0.1 dev eth0"), "{route}");
        let lo = run(&["nsenter", &nsarg, "ip", "-o", "link", "show", "lo"])?;
        assert!(lo.contains("UP"), "{lo}");
        let port = run(&["ip", "-o", "link", "show", &veth_name(&ids[0])])?;
        assert!(port.contains(&format!("master {BRIDGE}")), "{port}");
        // The host end, a bridge port, has no IPv6 address (whose probes the
        // bridge would flood to every pod); the pod's end keeps its
        // link-local one.
        let port = run(&["ip", "-d", "-o", "link", "show", &veth_name(&ids[0])])?;
        assert!(port.contains("addrgenmode none"), "{port}");
        let port6 = run(&["ip", "-6", "-o", "addr", "show", "dev", &veth_name(&ids[0])])?;
        assert!(port6.trim().is_empty(), "{port6}");
        let eth0_6 = run(&[
            "nsenter", &nsarg, "ip", "-6", "-o", "addr", "show", "dev", "eth0",
        ])?;
        assert!(eth0_6.contains("inet6 fe80::"), "{eth0_6}");
        // ... made without a duplicate-address probe, so not tentative
        // even in the sandbox made last, moments ago; and the pod sends no
        // router solicitations. Both would be multicast frames the bridge
        // floods to every other pod.
        let newest = format!("--net={}", net.netns_path(&ids[49]).display());
        let newest6 = run(&[
            "nsenter", &newest, "ip", "-6", "-o", "addr", "show", "dev", "eth0",
        ])?;
        assert!(newest6.contains("inet6 fe80::"), "{newest6}");
        assert!(!newest6.contains("tentative"), "{newest6}");
        for (key, want) in [("accept_dad", "0"), ("router_solicitations", "0")] {
            let path = format!("/proc/sys/net/ipv6/conf/eth0/{key}");
            let got = run(&["nsenter", &nsarg, "cat", &path])?;
            assert_eq!(got.trim(), want, "{key}");
        }
        // They were set inside the pod's namespace: the host's eth0 keeps
        // its settings.
        assert_eq!(host_eth0_v6()?, host_before);
        assert_eq!(host_before[0].trim(), "1", "accept_dad of a new link");

        for id in &ids {
            net.destroy(&ctx(id, SandboxSpec::default())).await?;
        }
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn destroy_is_idempotent_and_accepts_unknown_sandboxes() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.79.0.0/24");
        net.init().await?;
        let never = sid(1000);
        net.destroy(&ctx(&never, SandboxSpec::default())).await?;
        net.cleanup(&ctx(&never, SandboxSpec::default())).await?;

        let id = sid(1);
        let c = ctx(&id, SandboxSpec::default());
        net.create(&c).await?;
        net.destroy(&c).await?;
        net.destroy(&c).await?;
        net.cleanup(&c).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn detach_cuts_the_pod_off_and_remove_links_finishes_the_teardown() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.79.1.0/24");
        net.init().await?;
        let id = sid(7);
        net.create(&ctx(&id, SandboxSpec::default())).await?;
        let veth = veth_name(&id);
        assert!(run(&["ip", "-o", "link", "show", &veth])?.contains(",UP"));

        net.detach(&id, false).await?;
        // Off the network: no lease, the host end down; the links remain.
        assert_eq!(leases.len(), 0);
        assert!(net.ipam().leases().is_empty());
        let link = run(&["ip", "-o", "link", "show", &veth])?;
        assert!(!link.contains(",UP") && !link.contains("<UP"), "{link}");
        assert_eq!(pins(&env).len(), 1);
        net.detach(&id, false).await?;

        net.remove_links(&id).await?;
        net.remove_links(&id).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn destroy_under_the_engine_answers_before_the_links_are_deleted() {
    use cubelet_engine::{EngineBuilder, FlowConfig, FlowKind, WorkflowConfig};
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.79.2.0/24");
        net.init().await?;
        let flows = ["create", "destroy", "cleanup"]
            .into_iter()
            .map(|f| {
                let config = FlowConfig {
                    concurrent: 4,
                    steps: vec![vec!["network".to_owned()]],
                    admission_wait: std::time::Duration::ZERO,
                };
                (f.to_owned(), config)
            })
            .collect();
        let engine = EngineBuilder::new()
            .provider("network", net.clone())
            .build(&WorkflowConfig { flows })?;
        let ids: Vec<_> = (0..5).map(sid).collect();
        for id in &ids {
            let c = std::sync::Arc::new(ctx(id, SandboxSpec::default()));
            engine.run(FlowKind::Create, c).await?;
        }
        for id in &ids {
            let c = std::sync::Arc::new(ctx(id, SandboxSpec::default()));
            engine.run(FlowKind::Destroy, c).await?;
            // Answered once detached: the lease is free at once.
            assert!(net.ipam().lookup(id).is_none());
        }
        assert_eq!(leases.len(), 0);
        engine.drain().await;
        assert_eq!(engine.deferred_running(), 0);
        assert_clean(&env, &leases, &net)?;
        // A second destroy and a cleanup of the same sandboxes are no-ops.
        for id in &ids {
            for kind in [FlowKind::Destroy, FlowKind::Cleanup] {
                let c = std::sync::Arc::new(ctx(id, SandboxSpec::default()));
                engine.run(kind, c).await?;
            }
        }
        engine.drain().await;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn failure_after_each_substep_rolls_back() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.80.0.0/24");
        net.init().await?;
        let spec = SandboxSpec {
            port_mappings: vec![PortMapping {
                protocol: Protocol::Tcp,
                container_port: 80,
                host_port: 18080,
                host_ip: None,
            }],
            ..Default::default()
        };
        let steps = [
            SubStep::NetnsCreated,
            SubStep::VethCreated,
            SubStep::LeaseTaken,
            SubStep::AddressSet,
            SubStep::PortsMapped,
        ];
        for (n, step) in steps.into_iter().enumerate() {
            let id = sid(n as u64);
            net.fail_after(Some(step));
            let c = ctx(&id, spec.clone());
            let err = net.create(&c).await.unwrap_err();
            assert!(
                err.to_string().contains("injected failure"),
                "{step:?}: {err}"
            );
            assert!(
                c.get::<NetworkStatus>().is_none(),
                "nothing published on failure"
            );
            // create rolled its own partial work back ...
            assert_clean(&env, &leases, &net)?;
            // ... and the engine's failover destroy still succeeds.
            net.destroy(&c).await?;
            assert_clean(&env, &leases, &net)?;
        }
        net.fail_after(None);
        let c = ctx(&sid(99), spec);
        net.create(&c).await?;
        assert_eq!(port_rules(net.nft_table())?, 1);
        net.destroy(&c).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn two_sandboxes_can_ping_each_other() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.81.0.0/24");
        net.init().await?;
        let (a, b) = (sid(1), sid(2));
        let (ca, cb) = (
            ctx(&a, SandboxSpec::default()),
            ctx(&b, SandboxSpec::default()),
        );
        net.create(&ca).await?;
        net.create(&cb).await?;
        let sa: NetworkStatus = ca.get().expect("a");
        let sb: NetworkStatus = cb.get().expect("b");
        let pa = sa.netns_path.clone().expect("pin a");
        let pb = sb.netns_path.clone().expect("pin b");
        ping_from(&pa, v4(&sb))?;
        ping_from(&pb, v4(&sa))?;
        ping_from(&pa, net.gateway())?;
        net.destroy(&ca).await?;
        net.destroy(&cb).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn exhaustion_is_a_clear_error_and_leaks_nothing() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.82.0.0/29");
        net.init().await?;
        let ids: Vec<_> = (0..5).map(sid).collect();
        for id in &ids {
            net.create(&ctx(id, SandboxSpec::default())).await?;
        }
        let extra = sid(5);
        let err = net
            .create(&ctx(&extra, SandboxSpec::default()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::ResourceExhausted);
        assert!(err.to_string().contains("no free address"), "{err}");
        assert!(err.inner().downcast_ref::<NetworkError>().is_some());
        assert!(!pins(&env).contains(&extra.to_string()), "rolled back");
        assert!(!veths()?.contains(&veth_name(&extra)), "rolled back");
        for id in &ids {
            net.destroy(&ctx(id, SandboxSpec::default())).await?;
        }
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn gc_removes_what_no_live_sandbox_owns() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.83.0.0/24");
        net.init().await?;
        let spec = SandboxSpec {
            port_mappings: vec![PortMapping {
                protocol: Protocol::Udp,
                container_port: 53,
                host_port: 15353,
                host_ip: None,
            }],
            ..Default::default()
        };
        let ids: Vec<_> = (0..3).map(sid).collect();
        net.create(&ctx(&ids[0], SandboxSpec::default())).await?;
        net.create(&ctx(&ids[1], SandboxSpec::default())).await?;
        net.create(&ctx(&ids[2], spec)).await?;
        // A file whose name is not in Cubelet's id format: not Cubelet's,
        // left alone.
        let stray = env.state_dir.join("netns").join("Not-An-Id");
        std::fs::write(&stray, b"")?;

        let report = net.gc(&live(&[&ids[0]])).await?;
        assert!(stray.exists(), "a foreign file was removed");
        std::fs::remove_file(&stray)?;
        assert_eq!(report.netns, 2, "{report:?}");
        assert_eq!(report.veths, 2, "{report:?}");
        assert_eq!(report.leases, 2, "{report:?}");
        assert_eq!(report.port_rules, 1, "{report:?}");
        assert_eq!(pins(&env), vec![ids[0].to_string()]);
        assert_eq!(veths()?, vec![veth_name(&ids[0])]);
        assert_eq!(leases.len(), 1);

        let again = net.gc(&live(&[&ids[0]])).await?;
        assert_eq!(again.total(), 0, "{again:?}");
        net.destroy(&ctx(&ids[0], SandboxSpec::default())).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn restart_recovers_leases_from_the_store() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.84.0.0/24");
        net.init().await?;
        let a = sid(1);
        let ca = ctx(&a, SandboxSpec::default());
        net.create(&ca).await?;
        let ip_a = v4(&ca.get::<NetworkStatus>().expect("a"));

        // A new provider over the same store, as after a restart.
        let again =
            cubelet_network::BridgeNetwork::new(config(&env, "10.84.0.0/24"), leases.clone())?;
        again.init().await?;
        assert_eq!(again.ipam().lookup(&a), Some(ip_a));
        let b = sid(2);
        let cb = ctx(&b, SandboxSpec::default());
        again.create(&cb).await?;
        assert_ne!(v4(&cb.get::<NetworkStatus>().expect("b")), ip_a);
        again.destroy(&ca).await?;
        again.destroy(&cb).await?;
        drop(net);
        assert_clean(&env, &leases, &again)
    });
}

#[test]
fn host_network_pods_get_no_namespace() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.85.0.0/24");
        net.init().await?;
        fake_uplink()?;
        let id = sid(1);
        let c = ctx(&id, host_network_spec());
        net.create(&c).await?;
        let status: NetworkStatus = c.get().expect("status");
        assert_eq!(status.netns_path, None::<PathBuf>);
        assert_eq!(status.ips, vec![IpAddr::V4(UPLINK_IP)]);
        assert!(pins(&env).is_empty());
        net.destroy(&c).await?;
        run(&["ip", "link", "del", "tup0"])?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn host_ports_forward_to_the_pod_and_conflicts_are_rejected() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.86.0.0/24");
        net.init().await?;
        let mapping = PortMapping {
            protocol: Protocol::Tcp,
            container_port: 8080,
            host_port: 18081,
            host_ip: None,
        };
        let spec = SandboxSpec {
            port_mappings: vec![mapping.clone()],
            ..Default::default()
        };
        let a = sid(1);
        let ca = ctx(&a, spec.clone());
        net.create(&ca).await?;
        let pin = ca
            .get::<NetworkStatus>()
            .expect("a")
            .netns_path
            .expect("pin");

        // A listener inside the pod's namespace.
        let listener = std::thread::spawn(move || -> Result<String> {
            let ns = std::fs::File::open(&pin)?;
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let l = TcpListener::bind("0.0.0.0:8080")?;
            let mut peer = String::new();
            for _ in 0..2 {
                let (mut s, p) = l.accept()?;
                s.write_all(b"hello from the pod")?;
                peer = p.to_string();
            }
            Ok(peer)
        });
        // Reached through the test namespace's own bridge address.
        let target = (net.gateway(), 18081);
        let mut reply = String::new();
        let mut tries = 0;
        loop {
            match TcpStream::connect(target) {
                Ok(mut s) => {
                    s.read_to_string(&mut reply)?;
                    break;
                }
                // The listener thread may not be bound yet.
                Err(_) if tries < 50 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        }
        assert_eq!(reply, "hello from the pod");
        // And on the node's loopback address (route_localnet + masquerade).
        let status = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()?;
        assert!(status.success());
        let mut local = String::new();
        TcpStream::connect(("127.0.0.1", 18081))?.read_to_string(&mut local)?;
        assert_eq!(local, "hello from the pod");
        listener.join().expect("listener thread")?;

        let b = sid(2);
        let err = net.create(&ctx(&b, spec)).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::AlreadyExists, "{err}");
        assert!(
            !pins(&env).contains(&b.to_string()),
            "conflicting sandbox rolled back"
        );
        assert_eq!(port_rules(net.nft_table())?, 1, "a's rule kept");

        net.destroy(&ca).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn create_is_idempotent_and_concurrent_creates_do_not_collide() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.87.0.0/24");
        net.init().await?;
        let id = sid(1);
        let c = ctx(&id, SandboxSpec::default());
        net.create(&c).await?;
        let first: NetworkStatus = c.get().expect("first");
        net.create(&c).await?;
        let second: NetworkStatus = c.get().expect("second");
        assert_eq!(first, second, "a repeated create returns the same network");
        assert_eq!(leases.len(), 1);
        net.destroy(&c).await?;

        // Many creates in flight at once on one runtime.
        let ids: Vec<_> = (100..120).map(sid).collect();
        let ctxs: Vec<_> = ids.iter().map(|i| ctx(i, SandboxSpec::default())).collect();
        let results = futures::future::join_all(ctxs.iter().map(|c| net.create(c))).await;
        for r in results {
            r?;
        }
        let ips: std::collections::HashSet<_> = ctxs
            .iter()
            .map(|c| v4(&c.get::<NetworkStatus>().expect("status")))
            .collect();
        assert_eq!(ips.len(), 20);
        assert_eq!(veths()?.len(), 20);
        let results = futures::future::join_all(ctxs.iter().map(|c| net.destroy(c))).await;
        for r in results {
            r?;
        }
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn cancelled_create_rolls_back() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.86.0.0/24");
        net.init().await?;
        let id = sid(1);
        let token = tokio_util::sync::CancellationToken::new();
        token.cancel();
        let c = ctx(&id, SandboxSpec::default()).with_cancel(token);
        let err = net.create(&c).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::Cancelled, "{err}");
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn a_pod_reaches_another_pods_host_port_through_the_bridge_address() {
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.89.0.0/24");
        net.init().await?;
        let mapping = PortMapping {
            protocol: Protocol::Tcp,
            container_port: 7000,
            host_port: 17000,
            host_ip: None,
        };
        let a = sid(1);
        let ca = ctx(
            &a,
            SandboxSpec {
                port_mappings: vec![mapping],
                ..Default::default()
            },
        );
        net.create(&ca).await?;
        let b = sid(2);
        let cb = ctx(&b, SandboxSpec::default());
        net.create(&cb).await?;
        let pin_a = ca
            .get::<NetworkStatus>()
            .expect("a")
            .netns_path
            .expect("pin a");
        let pin_b = cb
            .get::<NetworkStatus>()
            .expect("b")
            .netns_path
            .expect("pin b");
        let gw = net.gateway();

        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || -> Result<IpAddr> {
            nix::sched::setns(
                &std::fs::File::open(&pin_a)?,
                nix::sched::CloneFlags::CLONE_NEWNET,
            )?;
            let l = TcpListener::bind("0.0.0.0:7000")?;
            ready_tx.send(())?;
            let (mut s, peer) = l.accept()?;
            s.write_all(b"hairpin")?;
            Ok(peer.ip())
        });
        ready_rx.recv()?;
        let client = std::thread::spawn(move || -> Result<String> {
            nix::sched::setns(
                &std::fs::File::open(&pin_b)?,
                nix::sched::CloneFlags::CLONE_NEWNET,
            )?;
            let mut s = TcpStream::connect((gw, 17000))?;
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            Ok(reply)
        });
        assert_eq!(client.join().expect("client")?, "hairpin");
        let seen = server.join().expect("server")?;
        assert_eq!(
            seen,
            IpAddr::V4(gw),
            "masqueraded to the gateway so replies return through NAT"
        );

        net.destroy(&ca).await?;
        net.destroy(&cb).await?;
        assert_clean(&env, &leases, &net)
    });
}

#[test]
fn init_refuses_a_link_of_the_bridge_name_that_is_not_a_bridge() {
    isolated(|env| async move {
        run(&[
            "ip", "link", "add", BRIDGE, "type", "veth", "peer", "name", "tup9",
        ])?;
        let (net, _) = provider(&env, "10.91.0.0/24");
        let err = net.init().await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("not a bridge"), "{err}");
        run(&["ip", "link", "del", BRIDGE])?;
        Ok(())
    });
}

#[test]
fn a_pod_with_a_user_namespace_gets_a_netns_that_namespace_owns() {
    use cubelet_engine::spec::{IdMapping, NamespaceOptions, UserNamespace};
    isolated(|env| async move {
        let (net, leases) = provider(&env, "10.91.0.0/24");
        net.init().await?;
        let map = IdMapping {
            container_id: 0,
            host_id: 100_000,
            length: 65_536,
        };
        let userns = UserNamespace {
            uids: map,
            gids: map,
        };
        let spec = SandboxSpec {
            namespaces: NamespaceOptions {
                userns: Some(userns),
                ..Default::default()
            },
            ..Default::default()
        };
        let (a, b) = (sid(1), sid(2));
        let c = ctx(&a, spec.clone());
        net.create(&c).await?;
        let status: NetworkStatus = c.get().expect("status published");
        let user_pin = status.userns_path.clone().expect("a user namespace pin");
        assert_eq!(user_pin, env.state_dir.join("userns").join(a.as_str()));
        let net_pin = net.netns_path(&a);
        let user = format!("--user={}", user_pin.display());
        let netns = format!("--net={}", net_pin.display());
        // The mappings are the pod's.
        let map_text = run(&["nsenter", &user, "cat", "/proc/self/uid_map"])?;
        assert_eq!(
            map_text.split_whitespace().collect::<Vec<_>>(),
            ["0", "100000", "65536"]
        );
        // Root of the pod's user namespace administers its network namespace
        // (it may not if the node's user namespace owned it), and sees the
        // pod's interface with its address.
        run(&[
            "nsenter",
            &user,
            &netns,
            "ip",
            "addr",
            "add",
            "192.0.2.9/32",
            "dev",
            "lo",
        ])?;
        let addr = run(&["nsenter", &user, &netns, "ip", "-o", "-4", "addr", "show"])?;
        assert!(addr.contains(&v4(&status).to_string()), "{addr}");
        // Without a user namespace a pod's netns is the node user namespace's.
        let plain = ctx(&b, SandboxSpec::default());
        net.create(&plain).await?;
        assert_eq!(plain.get::<NetworkStatus>().expect("b").userns_path, None);
        let owned_by_node = format!("--net={}", net.netns_path(&b).display());
        assert!(run(&[
            "nsenter",
            &user,
            &owned_by_node,
            "ip",
            "addr",
            "add",
            "192.0.2.9/32",
            "dev",
            "lo",
        ])
        .is_err());

        // The GC takes the user-namespace pin of a sandbox that is gone...
        let report = net.gc(&live(&[&b])).await?;
        assert_eq!(report.netns, 2, "netns and userns pins of a: {report:?}");
        assert!(!user_pin.exists());
        assert_eq!(pins(&env), vec![b.to_string()]);
        // ... and destroy takes it for a sandbox torn down normally.
        net.create(&c).await?;
        assert!(user_pin.exists());
        net.destroy(&c).await?;
        net.destroy(&plain).await?;
        assert!(!user_pin.exists());
        assert_eq!(ns_mounts(&env.state_dir), 0, "nsfs mounts left");
        assert_clean(&env, &leases, &net)
    });
}

/// Another runtime's bridge on the subnet (containerd's `cni0` on
/// 10.88.0.0/16): setup refuses, naming both subnets and the device once,
/// and makes no bridge; the bridge's own earlier address is no conflict.
#[test]
fn setup_refuses_a_subnet_another_interface_routes() {
    isolated(|env| async move {
        run(&["ip", "link", "add", "cni0", "type", "bridge"])?;
        run(&["ip", "addr", "add", "10.88.0.1/16", "dev", "cni0"])?;
        run(&["ip", "link", "set", "cni0", "up"])?;
        let (net, _) = provider(&env, "10.88.0.0/24");
        let err = net.setup().await.expect_err("overlapping subnet refused");
        assert!(matches!(err, NetworkError::SubnetOverlap { .. }), "{err:?}");
        let msg = err.to_string();
        assert_eq!(
            msg,
            "bridge subnet 10.88.0.0/24 overlaps route 10.88.0.0/16 dev cni0"
        );
        assert_eq!(msg.matches("cni0").count(), 1, "{msg}");
        assert!(!std::path::Path::new(&format!("/sys/class/net/{BRIDGE}")).exists());
        // A free subnet works, and setting it up again (the bridge's own
        // route and address now exist) is no conflict.
        let (net, _) = provider(&env, "10.86.0.0/24");
        net.setup().await?;
        net.setup().await?;
        Ok(())
    });
}
