//! Black-box tests of the CNI provider with Debian's real plugins (bridge,
//! host-local, portmap from containernetworking-plugins in /usr/lib/cni).
//! Each test runs in its own network and mount namespace (see `common`): the
//! plugins are children of the test thread, so their bridge, veths,
//! iptables rules and sysctls stay inside it. Config, cache and host-local's
//! data directory live in the test's temporary state dir.

mod common;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use common::*;
use cubelet_engine::spec::{NetworkStatus, PortMapping, Protocol, SandboxSpec};
use cubelet_engine::{Flow, StepErrorKind};
use cubelet_network::{CniConfig, CniNetwork, NetworkError, Readiness};

const PLUGIN_DIR: &str = "/usr/lib/cni";
const NETWORK: &str = "cnitest";
const CNI_BRIDGE: &str = "cnitest0";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 203, 0, 1);

/// True when the Debian plugins are installed; prints why a test is skipped otherwise.
fn have_plugins() -> bool {
    let missing: Vec<_> = ["bridge", "host-local", "portmap"]
        .into_iter()
        .filter(|p| !Path::new(PLUGIN_DIR).join(p).exists())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "SKIPPED: CNI plugins {missing:?} not in {PLUGIN_DIR} (apt-get install containernetworking-plugins)"
        );
    }
    missing.is_empty()
}

/// Runs `body` isolated, if the plugins are there.
fn cni_test<F, Fut>(body: F)
where
    F: FnOnce(Env) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<()>>,
{
    if have_plugins() {
        isolated(body);
    }
}

fn conf_dir(env: &Env) -> PathBuf {
    env.state_dir.join("net.d")
}

fn ipam_dir(env: &Env) -> PathBuf {
    env.state_dir.join("ipam")
}

fn cache_dir(env: &Env) -> PathBuf {
    env.state_dir.join("cni-cache")
}

/// Writes the test network: bridge + host-local, then portmap.
fn write_conflist(env: &Env) -> Result<()> {
    write_conf(
        env,
        &format!("10-{NETWORK}.conflist"),
        &conflist(env, "10.203.0.0/24"),
    )
}

fn conflist(env: &Env, subnet: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": CNI_BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "subnet": subnet,
                    "dataDir": ipam_dir(env),
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}
        ]
    })
    .to_string()
}

fn write_conf(env: &Env, name: &str, body: &str) -> Result<()> {
    std::fs::create_dir_all(conf_dir(env))?;
    std::fs::write(conf_dir(env).join(name), body)?;
    Ok(())
}

fn provider(env: &Env) -> CniNetwork {
    CniNetwork::new(CniConfig {
        bin_dirs: vec![PLUGIN_DIR.into()],
        conf_dir: conf_dir(env),
        state_dir: env.state_dir.clone(),
        cache_dir: cache_dir(env),
    })
    .expect("valid config")
}

fn v4(status: &NetworkStatus) -> Ipv4Addr {
    match status.ips.first() {
        Some(IpAddr::V4(ip)) => *ip,
        other => panic!("no IPv4 in {other:?}"),
    }
}

/// veth links in the test namespace.
fn veth_count() -> Result<usize> {
    Ok(run(&["ip", "-o", "link", "show", "type", "veth"])?
        .lines()
        .count())
}

/// Addresses host-local holds (files named by address in its data dir).
fn ipam_leases(env: &Env) -> Vec<String> {
    std::fs::read_dir(ipam_dir(env).join(NETWORK))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.parse::<IpAddr>().is_ok())
                .collect()
        })
        .unwrap_or_default()
}

fn cache_entries(env: &Env) -> Vec<String> {
    std::fs::read_dir(cache_dir(env).join("results"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Nothing of any sandbox is left: no pins or nsfs mounts, no veths, no
/// host-local leases, no cache entries.
fn assert_cni_clean(env: &Env) -> Result<()> {
    assert_eq!(pins(env), Vec::<String>::new(), "netns pins left");
    assert_eq!(ns_mounts(&env.state_dir), 0, "nsfs mounts left");
    assert_eq!(veth_count()?, 0, "veths left");
    assert_eq!(
        ipam_leases(env),
        Vec::<String>::new(),
        "host-local leases left"
    );
    assert_eq!(
        cache_entries(env),
        Vec::<String>::new(),
        "cache entries left"
    );
    Ok(())
}

fn pod_spec(name: &str) -> SandboxSpec {
    SandboxSpec {
        name: name.into(),
        namespace: "default".into(),
        uid: format!("uid-{name}"),
        ..SandboxSpec::default()
    }
}

#[test]
fn create_and_destroy_twenty_sandboxes_leaves_nothing() {
    cni_test(|env| async move {
        write_conflist(&env)?;
        let net = provider(&env);
        net.init().await?;
        assert_eq!(net.ready(), Readiness::Ready);
        let versions = net.versions().await?;
        assert_eq!(versions.len(), 2);
        assert!(versions.iter().all(|v| v.compatible), "{versions:?}");

        let ids: Vec<_> = (0..20).map(sid).collect();
        let mut ips = HashSet::new();
        for (n, id) in ids.iter().enumerate() {
            let c = ctx(id, pod_spec(&format!("pod{n}")));
            net.create(&c).await?;
            let status: NetworkStatus = c.get().expect("status published");
            assert_eq!(status.netns_path, Some(net.netns_path(id)));
            assert_eq!(status.interface.as_deref(), Some("eth0"));
            let ip = v4(&status);
            assert!(
                "10.203.0.0/24".parse::<ipnet::Ipv4Net>()?.contains(&ip),
                "{ip}"
            );
            assert!(ips.insert(ip), "duplicate address {ip}");
            assert!(net.cache_path(NETWORK, id).exists());
        }
        assert_eq!(pins(&env).len(), 20);
        assert_eq!(veth_count()?, 20);
        assert_eq!(ipam_leases(&env).len(), 20);
        assert_eq!(cache_entries(&env).len(), 20);

        // Inside one sandbox: lo up, eth0 addressed, default route via the bridge.
        let nsarg = format!("--net={}", net.netns_path(&ids[0]).display());
        let lo = run(&["nsenter", &nsarg, "ip", "-o", "link", "show", "lo"])?;
        assert!(lo.contains("UP"), "{lo}");
        let addr = run(&[
            "nsenter", &nsarg, "ip", "-o", "-4", "addr", "show", "dev", "eth0",
        ])?;
        assert!(addr.contains("10.203.0."), "{addr}");
        let route = run(&["nsenter", &nsarg, "ip", "-4", "route", "show", "default"])?;
        assert!(route.contains(&format!("via {GATEWAY}")), "{route}");
        // The cache holds config and result, and CHECK passes with it.
        let cached: serde_json::Value =
            serde_json::from_slice(&std::fs::read(net.cache_path(NETWORK, &ids[0]))?)?;
        assert_eq!(cached["config"]["name"], NETWORK);
        assert_eq!(cached["containerId"], ids[0].as_str());
        assert!(cached["result"]["ips"].is_array(), "{cached}");
        net.check_sandbox(&ids[0]).await?;

        for (n, id) in ids.iter().enumerate() {
            let c = ctx(id, pod_spec(&format!("pod{n}")));
            net.destroy(&c).await?;
            // Twice: the second DEL runs from the config alone and succeeds.
            net.destroy(&c).await?;
        }
        net.cleanup(&ctx(&ids[0], pod_spec("pod0"))).await?;
        assert_cni_clean(&env)
    });
}

#[test]
fn del_after_restart_uses_the_cached_config_and_result() {
    cni_test(|env| async move {
        write_conflist(&env)?;
        let id = sid(7);
        let c = ctx(&id, pod_spec("survivor"));
        {
            let first = provider(&env);
            first.init().await?;
            first.create(&c).await?;
        }
        assert_eq!(ipam_leases(&env).len(), 1);
        // The config goes away (or changes) while the agent is down: the
        // new instance still deletes with what ADD used.
        std::fs::remove_file(conf_dir(&env).join(format!("10-{NETWORK}.conflist")))?;
        let second = provider(&env);
        second.init().await?;
        assert!(!second.ready().is_ready());
        second.destroy(&c).await?;
        second.destroy(&c).await?;
        assert_cni_clean(&env)
    });
}

#[test]
fn two_pods_ping_each_other() {
    cni_test(|env| async move {
        write_conflist(&env)?;
        let net = provider(&env);
        net.init().await?;
        let (a, b) = (sid(1), sid(2));
        let sa = net.create_sandbox(&a, &pod_spec("a")).await?;
        let sb = net.create_sandbox(&b, &pod_spec("b")).await?;
        ping_from(&net.netns_path(&a), v4(&sb))?;
        ping_from(&net.netns_path(&b), v4(&sa))?;
        ping_from(&net.netns_path(&a), GATEWAY)?;
        net.teardown(&a, &pod_spec("a")).await?;
        net.teardown(&b, &pod_spec("b")).await?;
        assert_cni_clean(&env)
    });
}

/// Accepts one connection inside the namespace pinned at `pin` and greets it.
fn serve_once_in(pin: PathBuf, port: u16) -> Result<std::thread::JoinHandle<Result<()>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || -> Result<()> {
        let ns = std::fs::File::open(&pin)?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let listener = TcpListener::bind(("0.0.0.0", port))?;
        tx.send(()).ok();
        let (mut conn, _) = listener.accept()?;
        conn.write_all(b"hello from the pod")?;
        Ok(())
    });
    rx.recv_timeout(Duration::from_secs(10))
        .context("listener did not start")?;
    Ok(handle)
}

#[test]
fn host_port_reaches_a_listener_in_the_pod() {
    cni_test(|env| async move {
        write_conflist(&env)?;
        let net = provider(&env);
        net.init().await?;
        let id = sid(3);
        let spec = SandboxSpec {
            port_mappings: vec![PortMapping {
                protocol: Protocol::Tcp,
                container_port: 8080,
                host_port: 18080,
                host_ip: None,
            }],
            ..pod_spec("web")
        };
        let c = ctx(&id, spec.clone());
        net.create(&c).await?;
        let cached: serde_json::Value =
            serde_json::from_slice(&std::fs::read(net.cache_path(NETWORK, &id))?)?;
        assert_eq!(
            cached["capabilityArgs"]["portMappings"][0]["hostPort"],
            18080
        );
        let server = serve_once_in(net.netns_path(&id), 8080)?;
        // The bridge's address is local to the test namespace: portmap's
        // OUTPUT DNAT sends the connection into the pod.
        let mut conn = TcpStream::connect_timeout(
            &SocketAddr::from((GATEWAY, 18080)),
            Duration::from_secs(10),
        )?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut got = String::new();
        conn.read_to_string(&mut got)?;
        assert_eq!(got, "hello from the pod");
        server.join().expect("server thread")?;

        net.destroy(&c).await?;
        let nat = run(&["iptables", "-t", "nat", "-S"])?;
        assert!(
            !nat.contains(id.as_str()),
            "portmap rules of the sandbox left:\n{nat}"
        );
        assert_cni_clean(&env)
    });
}

#[test]
fn without_config_the_network_is_not_ready_and_create_fails_cleanly() {
    cni_test(|env| async move {
        let net = provider(&env);
        net.init().await?;
        match net.ready() {
            Readiness::NotReady { reason, message } => {
                assert_eq!(reason, "NetworkPluginNotReady");
                assert_eq!(
                    message,
                    format!("no network config found in {}", conf_dir(&env).display())
                );
            }
            Readiness::Ready => panic!("ready without a config"),
        }
        let id = sid(4);
        let err = net.create(&ctx(&id, pod_spec("p"))).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::FailedPrecondition, "{err}");
        net.destroy(&ctx(&id, pod_spec("p"))).await?;
        assert_cni_clean(&env)?;

        // A config naming a plugin that is not installed: still not ready.
        write_conf(
            &env,
            "05-missing.conf",
            r#"{"cniVersion":"1.0.0","name":"m","type":"no-such-plugin"}"#,
        )?;
        let not_ready = net.ready();
        assert!(
            matches!(&not_ready, Readiness::NotReady { message, .. } if message.contains("no-such-plugin")),
            "{not_ready:?}"
        );
        std::fs::remove_file(conf_dir(&env).join("05-missing.conf"))?;
        write_conflist(&env)?;
        assert!(net.ready().is_ready());
        Ok(())
    });
}

#[test]
fn plugin_errors_name_the_plugin_and_roll_back() {
    cni_test(|env| async move {
        // A range of one address: the second pod cannot get one.
        let mut conf: serde_json::Value = serde_json::from_str(&conflist(&env, "10.203.0.0/24"))?;
        conf["plugins"][0]["ipam"]["rangeStart"] = "10.203.0.10".into();
        conf["plugins"][0]["ipam"]["rangeEnd"] = "10.203.0.10".into();
        write_conf(&env, "10-tiny.conflist", &conf.to_string())?;
        let net = provider(&env);
        net.init().await?;
        let (first, second) = (sid(5), sid(6));
        let status = net.create_sandbox(&first, &pod_spec("a")).await?;
        assert_eq!(v4(&status), Ipv4Addr::new(10, 203, 0, 10));
        let err = net
            .create_sandbox(&second, &pod_spec("b"))
            .await
            .unwrap_err();
        match &err {
            NetworkError::CniPlugin {
                plugin,
                command,
                msg,
                ..
            } => {
                assert_eq!(plugin, "bridge");
                assert_eq!(*command, "ADD");
                assert!(msg.contains("no IP addresses available"), "{msg}");
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(
            err.to_string().starts_with("cni plugin bridge ADD failed"),
            "{err}"
        );
        // The failed sandbox was rolled back; the first one is intact.
        assert_eq!(pins(&env), vec![first.as_str().to_owned()]);
        assert_eq!(cache_entries(&env).len(), 1);
        net.teardown(&first, &pod_spec("a")).await?;
        assert_cni_clean(&env)
    });
}

#[test]
fn gc_deletes_dead_sandboxes_and_spares_live_ones() {
    cni_test(|env| async move {
        write_conflist(&env)?;
        let net = provider(&env);
        net.init().await?;
        let ids: Vec<_> = (10..13).map(sid).collect();
        for id in &ids {
            net.create_sandbox(id, &pod_spec("g")).await?;
        }
        // A pin left by a create that died before ADD.
        let stray = sid(99);
        run(&["touch", &net.netns_path(&stray).to_string_lossy()])?;

        let report = net.gc(&live(&[&ids[0]])).await?;
        assert_eq!(report.attachments, 2, "{report:?}");
        assert_eq!(report.netns, 1, "{report:?}");
        assert_eq!(report.failed, 0, "{report:?}");
        assert_eq!(pins(&env), vec![ids[0].as_str().to_owned()]);
        assert_eq!(ipam_leases(&env).len(), 1);
        assert_eq!(veth_count()?, 1);
        net.check_sandbox(&ids[0]).await?;

        let again = net.gc(&live(&[&ids[0]])).await?;
        assert_eq!(again, Default::default());
        net.teardown(&ids[0], &pod_spec("g")).await?;
        assert_cni_clean(&env)
    });
}
