//! Resource limits: CRI resources to OCI `LinuxResources`, the
//! `oom_score_adj` floor, and the container's cgroup path.

use std::collections::HashMap;

use oci_spec::runtime::{
    LinuxCpuBuilder, LinuxHugepageLimitBuilder, LinuxMemoryBuilder, LinuxResources,
    LinuxResourcesBuilder,
};

use super::model::Resources;
use super::oci_err;
use crate::cgroup::CgroupDriver;
use crate::error::RuntimeError;

/// Converts [`Resources`] to OCI `LinuxResources`, with the device rules of
/// an unprivileged container when `devices` is given.
pub fn linux_resources(r: &Resources) -> Result<LinuxResources, RuntimeError> {
    let mut cpu = LinuxCpuBuilder::default();
    if r.cpu_shares > 0 {
        cpu = cpu.shares(r.cpu_shares);
    }
    if r.cpu_quota != 0 {
        cpu = cpu.quota(r.cpu_quota);
    }
    if r.cpu_period > 0 {
        cpu = cpu.period(r.cpu_period);
    }
    if !r.cpuset_cpus.is_empty() {
        cpu = cpu.cpus(r.cpuset_cpus.clone());
    }
    if !r.cpuset_mems.is_empty() {
        cpu = cpu.mems(r.cpuset_mems.clone());
    }
    let mut mem = LinuxMemoryBuilder::default();
    if r.memory_limit > 0 {
        mem = mem.limit(r.memory_limit);
    }
    if r.memory_swap_limit != 0 {
        mem = mem.swap(r.memory_swap_limit);
    }
    let hugepages = r
        .hugepages
        .iter()
        .map(|h| {
            LinuxHugepageLimitBuilder::default()
                .page_size(h.page_size.clone())
                .limit(i64::try_from(h.limit).unwrap_or(i64::MAX))
                .build()
                .map_err(oci_err("resources.hugepage_limits"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut b = LinuxResourcesBuilder::default()
        .cpu(cpu.build().map_err(oci_err("resources.cpu"))?)
        .memory(mem.build().map_err(oci_err("resources.memory"))?);
    if !hugepages.is_empty() {
        b = b.hugepage_limits(hugepages);
    }
    if !r.unified.is_empty() {
        b = b.unified(
            r.unified
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        );
    }
    b.build().map_err(oci_err("resources"))
}

/// The `oom_score_adj` the container gets: the request, raised to the floor.
pub fn clamp_oom_score_adj(requested: i32, floor: Option<i32>) -> i32 {
    match floor {
        Some(f) if requested < f => f,
        _ => requested,
    }
}

/// The cgroupfs path of a container: `<cgroup_parent>/<id>`
/// ([`CgroupDriver::container_dir`] of the cgroupfs driver; what knows the
/// node's driver asks [`CgroupDriver`] itself).
pub fn cgroup_path(cgroup_parent: Option<&str>, id: &str) -> String {
    CgroupDriver::Cgroupfs.container_dir(cgroup_parent, id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::image;
    use crate::spec::{build_oci_spec, ContainerSpec, SpecOptions};

    #[test]
    fn oom_score_adj_is_clamped_to_the_agent_floor() {
        assert_eq!(clamp_oom_score_adj(-999, Some(-500)), -500);
        assert_eq!(clamp_oom_score_adj(100, Some(-500)), 100);
        assert_eq!(clamp_oom_score_adj(-999, None), -999);
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            resources: Resources {
                oom_score_adj: -998,
                ..Default::default()
            },
            ..Default::default()
        };
        let opts = SpecOptions {
            min_oom_score_adj: Some(0),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &opts).unwrap();
        assert_eq!(oci.process().as_ref().unwrap().oom_score_adj(), Some(0));
    }
}
