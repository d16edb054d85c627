//! `cubelet uninstall` as an operator runs it: the real binary, a real
//! configuration file, real directories and a real admin socket. The parts
//! that need root and a containerd (mounts, bridge, nft, containerd objects)
//! are run by `hack/test-package.sh` through the package's `apt purge`.

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Output};

fn uninstall(config: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cubelet"))
        .args(["uninstall", "--config"])
        .arg(config)
        .output()
        .expect("run cubelet uninstall")
}

/// A configuration whose every host path is under `dir`, with no network
/// provider and no containerd to talk to.
fn write_config(dir: &Path) -> std::path::PathBuf {
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "socket: {d}/run/cri.sock\nroot_dir: {d}/lib/cubelet\nstate_dir: {d}/run/cubelet\n\
             containerd: {{ address: {d}/no-containerd.sock }}\nnetwork: {{ provider: none }}\n",
            d = dir.display()
        ),
    )
    .expect("write config");
    config
}

#[test]
fn removes_the_state_and_root_directories_and_the_socket_and_is_idempotent() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = write_config(tmp.path());
    let root = tmp.path().join("lib/cubelet");
    let state = tmp.path().join("run/cubelet");
    std::fs::create_dir_all(root.join("sandboxes/abc")).expect("mkdir");
    std::fs::write(root.join("cubelet.redb"), b"x").expect("write");
    std::fs::create_dir_all(state.join("netns")).expect("mkdir");
    std::fs::write(tmp.path().join("run/cri.sock"), b"").expect("write");

    let out = uninstall(&config);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!root.exists() && !state.exists(), "{stdout}");
    assert!(!tmp.path().join("run/cri.sock").exists());
    assert!(
        stdout.contains(&format!("removed directory {}", root.display())),
        "{stdout}"
    );
    assert!(
        config.exists(),
        "the configuration is the package's, not uninstall's"
    );

    let again = uninstall(&config);
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8_lossy(&again.stdout).trim(),
        "cubelet uninstall: done",
        "a second run has nothing to remove"
    );
}

#[test]
fn refuses_while_an_agent_answers_on_its_admin_socket() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = write_config(tmp.path());
    let state = tmp.path().join("run/cubelet");
    std::fs::create_dir_all(&state).expect("mkdir");
    let _agent = UnixListener::bind(state.join("admin.sock")).expect("bind");

    let out = uninstall(&config);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a Cubelet is running") && stderr.contains("admin.sock"),
        "{stderr}"
    );
    assert!(state.exists(), "nothing removed");
}

#[test]
fn a_bad_configuration_is_exit_code_2_naming_the_key() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = tmp.path().join("config.yaml");
    std::fs::write(&config, "no_such_key: 1\n").expect("write");
    let out = uninstall(&config);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_key"));
}
