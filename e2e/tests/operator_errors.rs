//! An operator's mistakes, made against the real `cubelet` binary, each
//! named once with its cause (issue 31):
//!
//! - a runtime handler whose binary is missing: CRI `Status` says
//!   RuntimeReady false with reason `RuntimeBinaryMissing` naming the path,
//!   and `--check-config` fails naming it;
//! - a wrong containerd socket: every try is logged at once at WARN with the
//!   address (text and JSON log formats), and start-up fails after
//!   `containerd.connect_attempts` with one final line;
//! - a second instance on the same state_dir: refused, naming the first
//!   one's pid;
//! - a bridge subnet another interface routes: refused, naming both.
//!
//! Without the private containerd each test prints SKIP and passes.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use cubelet_e2e::cri::StatusRequest;
use cubelet_e2e::{
    containerd_socket, cubelet_bin, mounts_under, run, skip_reason, with_daemon, workspace_root,
    DaemonOpts,
};

const MISSING_RUNC: &str = "/nonexistent/cubelet-e2e/runc";

/// Runs the cubelet binary with `args` and `env`, waiting at most 60 s.
async fn cubelet(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Output> {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(cubelet_bin())
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("CUBELET_LOG_FORMAT")
            .envs(env.iter().copied())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("cubelet did not exit within 60 s")?
    .context("run cubelet")?;
    println!(
        "$ cubelet {} -> {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The config files of a running test daemon, as `cubelet` arguments.
fn config_args(dir: &Path) -> [String; 4] {
    [
        "--config".to_owned(),
        dir.join("config.yaml").display().to_string(),
        "--config-dir".to_owned(),
        dir.join("config.d").display().to_string(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_runtime_binary_is_named_by_status_and_check_config() {
    let opts = DaemonOpts {
        index: 40,
        extra_config: Some(format!(
            "runtime:\n  handlers:\n    runc-alt: {{ binary: {MISSING_RUNC} }}\n"
        )),
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(120), |d| {
        Box::pin(async move {
            let status = d
                .runtime
                .clone()
                .status(StatusRequest { verbose: false })
                .await?
                .into_inner();
            let conds = status.status.context("no runtime status")?.conditions;
            let ready = conds
                .iter()
                .find(|c| c.r#type == "RuntimeReady")
                .context("no RuntimeReady condition")?;
            ensure!(
                !ready.status,
                "RuntimeReady with a missing binary: {ready:?}"
            );
            ensure!(ready.reason == "RuntimeBinaryMissing", "{ready:?}");
            ensure!(
                ready.message
                    == format!("runtime handler runc-alt: binary {MISSING_RUNC} not found"),
                "{ready:?}"
            );

            let args = config_args(d.config_dir());
            let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
            argv.push("--check-config");
            let out = cubelet(&argv, &[]).await?;
            ensure!(out.status.code() == Some(1), "exit {}", out.status);
            let stdout = text(&out.stdout);
            ensure!(
                stdout.contains(&format!(
                    "FAIL  runtime handler runc-alt: binary {MISSING_RUNC} not found\n"
                )),
                "{stdout}"
            );
            ensure!(stdout.matches(MISSING_RUNC).count() == 1, "{stdout}");
            ensure!(
                stdout.contains("ok    runtime handler runc: /usr/sbin/runc\n"),
                "{stdout}"
            );
            ensure!(
                stdout.contains(&format!(
                    "ok    containerd at {}: version ",
                    d.containerd.display()
                )),
                "{stdout}"
            );
            // The daemon's own bridge is no conflict for its subnet.
            ensure!(
                stdout.contains(&format!("ok    network.bridge.subnet: {}/24: ", d.subnet)),
                "{stdout}"
            );
            Ok(())
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_names_the_first_ones_pid() {
    with_daemon(
        DaemonOpts {
            index: 41,
            ..Default::default()
        },
        Duration::from_secs(120),
        |d| {
            Box::pin(async move {
                let pid = d.pid().context("daemon pid")?;
                let args = config_args(d.config_dir());
                let argv: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = cubelet(&argv, &[]).await?;
                ensure!(out.status.code() == Some(1), "exit {}", out.status);
                let stderr = text(&out.stderr);
                let want = format!(
                    "cubelet: another Cubelet is running (pid {pid}) with state_dir {}\n",
                    d.state_dir.display()
                );
                ensure!(stderr.ends_with(&want), "{stderr}");
                ensure!(stderr.matches("another Cubelet").count() == 1, "{stderr}");
                ensure!(!stderr.contains("Database"), "{stderr}");
                // The first one is unharmed.
                d.runtime
                    .clone()
                    .status(StatusRequest { verbose: false })
                    .await
                    .context("the first daemon still serves")?;
                Ok(())
            })
        },
    )
    .await;
}

/// Directories and config of a daemon started by hand (not through the
/// harness, which waits for a ready daemon); removed on drop.
struct Scratch {
    run_base: PathBuf,
    lib_base: PathBuf,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Scratch {
    /// A config with `containerd` as the socket (plus `containerd_extra`
    /// keys of that section) and the `network` section's body.
    fn new(
        tag: &str,
        containerd: &Path,
        containerd_extra: &str,
        network: &str,
    ) -> anyhow::Result<Scratch> {
        let pid = std::process::id();
        let run_base = PathBuf::from(format!("/run/cubelet-e2e-{pid}-{tag}"));
        let lib_base = PathBuf::from(format!("/var/lib/cubelet-e2e-{pid}-{tag}"));
        let dir = tempfile::Builder::new()
            .prefix("cubelet-e2e-config")
            .tempdir()?;
        let pause = std::env::var_os("CUBELET_PAUSE_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_root().join("target/cubelet-pause"));
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "socket: {run}/cubelet.sock\nroot_dir: {lib}/root\nstate_dir: {run}/state\n\
                 containerd:\n  address: {ctrd}\n  namespace: cubelet-e2e-{pid}-{tag}\n{containerd_extra}\
                 metrics:\n  address: 127.0.0.1:0\n\
                 images:\n  pause_binary: {pause}\n  registry_config_dir: {certs}\n\
                 network:\n{network}",
                run = run_base.display(),
                lib = lib_base.display(),
                ctrd = containerd.display(),
                pause = pause.display(),
                certs = dir.path().join("certs.d").display(),
            ),
        )?;
        Ok(Scratch {
            run_base,
            lib_base,
            config,
            _dir: dir,
        })
    }

    fn args(&self) -> [String; 4] {
        [
            "--config".to_owned(),
            self.config.display().to_string(),
            "--config-dir".to_owned(),
            self._dir.path().join("config.d").display().to_string(),
        ]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for m in mounts_under(&[self.run_base.as_path(), self.lib_base.as_path()])
            .iter()
            .rev()
        {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.run_base);
        let _ = std::fs::remove_dir_all(&self.lib_base);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_containerd_socket_is_logged_at_once_and_named_once() {
    if let Some(reason) = skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let wrong = PathBuf::from(format!(
        "/run/cubelet-e2e-{}-nowhere/containerd.sock",
        std::process::id()
    ));
    let s = Scratch::new(
        "ctrd",
        &wrong,
        "  connect_attempts: 3\n",
        "  provider: none\n",
    )
    .expect("scratch config");
    let args = s.args();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let addr = wrong.display().to_string();

    let started = Instant::now();
    let out = cubelet(&argv, &[("CUBELET_LOG", "info")])
        .await
        .expect("run");
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(1), "exit {}", out.status);
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let stderr = text(&out.stderr);
    let warns: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("does not answer"))
        .collect();
    assert_eq!(
        warns.len(),
        2,
        "one WARN per failed try but the last:\n{stderr}"
    );
    for (i, w) in warns.iter().enumerate() {
        assert!(
            w.contains(&format!(
                "containerd at {addr} does not answer (attempt {} of 3",
                i + 1
            )),
            "{w}"
        );
        assert_eq!(w.matches(&addr).count(), 1, "{w}");
    }
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!(
            "cubelet: containerd at {addr} does not answer after 3 attempts: "
        )),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("does not answer after").count(),
        1,
        "{stderr}"
    );
    // The cause is named once in the final line.
    let cause = last.rsplit_once("attempts: ").map_or("", |(_, c)| c);
    assert!(!cause.is_empty(), "{last}");
    assert_eq!(last.matches(cause).count(), 1, "{last}");

    // The same as JSON: one object per line, the address in its message.
    let out = cubelet(
        &argv,
        &[("CUBELET_LOG", "info"), ("CUBELET_LOG_FORMAT", "json")],
    )
    .await
    .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let objects: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let warns: Vec<&serde_json::Value> = objects.iter().filter(|o| o["level"] == "WARN").collect();
    assert_eq!(warns.len(), 2, "{stderr}");
    for w in warns {
        let msg = w["fields"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(&format!("containerd at {addr} does not answer")),
            "{w}"
        );
    }
    // An unknown format is refused before anything else.
    let out = cubelet(&argv, &[("CUBELET_LOG_FORMAT", "xml")])
        .await
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("CUBELET_LOG_FORMAT=\"xml\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subnet_another_interface_routes_is_refused_naming_both() {
    if let Some(reason) = skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let n = 100 + std::process::id() % 100;
    let other = format!("cbe2eov{n}");
    let subnet = format!("10.202.{n}.0/24");
    // Another runtime's bridge, as containerd's cni0 on 10.88.0.0/16.
    let _ = run("ip", &["link", "del", &other]).await;
    run("ip", &["link", "add", &other, "type", "bridge"])
        .await
        .expect("add bridge");
    struct Link(String);
    impl Drop for Link {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &self.0])
                .status();
        }
    }
    let _link = Link(other.clone());
    run(
        "ip",
        &["addr", "add", &format!("10.202.{n}.1/24"), "dev", &other],
    )
    .await
    .expect("address");
    run("ip", &["link", "set", &other, "up"]).await.expect("up");

    let bridge = format!("cbe2eob{n}");
    let s = Scratch::new(
        "subnet",
        &containerd_socket(),
        "",
        &format!("  provider: bridge\n  bridge: {{ name: {bridge}, subnet: {subnet} }}\n"),
    )
    .expect("scratch config");
    let args = s.args();
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let want = format!("bridge subnet {subnet} overlaps route {subnet} dev {other}");

    argv.push("--check-config");
    let out = cubelet(&argv, &[]).await.expect("run");
    assert_eq!(out.status.code(), Some(1), "exit {}", out.status);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!("FAIL  network.bridge.subnet: {want}\n")),
        "{stdout}"
    );
    argv.pop();

    let out = cubelet(&argv, &[]).await.expect("run");
    assert_eq!(out.status.code(), Some(1), "exit {}", out.status);
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&want), "{stderr}");
    assert_eq!(stderr.matches(&want).count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches(&format!("dev {other}")).count(),
        1,
        "{stderr}"
    );
    // Refused before the bridge was made.
    assert!(!Path::new(&format!("/sys/class/net/{bridge}")).exists());
    let ns = format!("cubelet-e2e-{}-subnet", std::process::id());
    let _ = run(
        "ctr",
        &[
            "--address",
            &containerd_socket().display().to_string(),
            "namespaces",
            "remove",
            &ns,
        ],
    )
    .await;
}
