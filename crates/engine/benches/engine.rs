//! Engine overhead with no-op providers: 3 stages of 2 parallel steps each.
//!
//! Criterion measures the mean; afterwards the bench times individual calls
//! and prints p50/p99 per flow and per rejection, the figures the project
//! tracks (targets on a 2-core machine: < 20 µs per flow, < 2 µs per rejection).

#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::Criterion;
use cubelet_engine::{
    EngineBuilder, Flow, FlowConfig, FlowContext, FlowKind, SandboxId, StepError, WorkflowConfig,
};

struct Noop;

#[async_trait]
impl Flow for Noop {
    async fn create(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        Ok(())
    }
    async fn destroy(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        Ok(())
    }
    async fn cleanup(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        Ok(())
    }
}

/// Never finishes its create: holds a flow in flight for the rejection bench.
struct Hold;

#[async_trait]
impl Flow for Hold {
    async fn create(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        std::future::pending().await
    }
    async fn destroy(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        Ok(())
    }
    async fn cleanup(&self, _ctx: &FlowContext) -> Result<(), StepError> {
        Ok(())
    }
}

fn config(concurrent: i64) -> WorkflowConfig {
    let stages: Vec<Vec<String>> = [["a", "b"], ["c", "d"], ["e", "f"]]
        .iter()
        .map(|s| s.map(String::from).to_vec())
        .collect();
    let mut flows = std::collections::BTreeMap::new();
    for name in ["create", "destroy", "cleanup"] {
        flows.insert(
            name.to_owned(),
            FlowConfig {
                concurrent,
                steps: stages.clone(),
                admission_wait: std::time::Duration::ZERO,
            },
        );
    }
    WorkflowConfig { flows }
}

fn engine(hold: bool, concurrent: i64) -> cubelet_engine::Engine {
    let mut b = EngineBuilder::new();
    for name in ["a", "b", "c", "d", "e", "f"] {
        let step: Arc<dyn Flow> = if hold && name == "a" {
            Arc::new(Hold)
        } else {
            Arc::new(Noop)
        };
        b = b.provider(name, step);
    }
    b.build(&config(concurrent)).unwrap()
}

fn ctx() -> Arc<FlowContext> {
    Arc::new(FlowContext::new(
        SandboxId::new_unchecked("bench"),
        Arc::default(),
    ))
}

fn percentiles(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    println!(
        "{name}: p50 {:.2} µs  p90 {:.2} µs  p99 {:.2} µs  (n = {})",
        at(0.50).as_secs_f64() * 1e6,
        at(0.90).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        samples.len()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let flows = engine(false, 0);
    let held = engine(true, 1);
    // Put one flow in flight so every further create is rejected.
    let hold_engine = held.clone();
    rt.spawn(async move { hold_engine.run(FlowKind::Create, ctx()).await });
    rt.block_on(async {
        while held.limits()[0].1.inflight < 1 {
            tokio::task::yield_now().await;
        }
    });

    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(Duration::from_secs(1));
    // Each measurement runs on a runtime worker, where CRI handlers call the engine.
    let on_worker = |engine: cubelet_engine::Engine, reject: bool| {
        let rt = &rt;
        move |iters: u64| {
            let engine = engine.clone();
            rt.block_on(rt.spawn(async move {
                let t = Instant::now();
                for _ in 0..iters {
                    let r = engine.run(FlowKind::Create, ctx()).await;
                    assert_eq!(r.is_err(), reject);
                }
                t.elapsed()
            }))
            .unwrap()
        }
    };
    c.bench_function("engine/flow_3x2_noop", |b| {
        b.iter_custom(on_worker(flows.clone(), false))
    });
    c.bench_function("engine/rejection", |b| {
        b.iter_custom(on_worker(held.clone(), true))
    });
    c.final_summary();

    // CRI handlers run on the runtime's workers, so time the calls from a
    // task on a worker too, as the agent makes them.
    let n = 20_000;
    let flows2 = flows.clone();
    let flow_samples = rt
        .block_on(rt.spawn(async move {
            let flows = flows2;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let c = ctx();
                let t = Instant::now();
                flows.run(FlowKind::Create, c).await.unwrap();
                v.push(t.elapsed());
            }
            v
        }))
        .unwrap();
    let held2 = held.clone();
    let reject_samples = rt
        .block_on(rt.spawn(async move {
            let held = held2;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let c = ctx();
                let t = Instant::now();
                held.run(FlowKind::Create, c).await.unwrap_err();
                v.push(t.elapsed());
            }
            v
        }))
        .unwrap();
    percentiles("flow (3 stages x 2 no-op steps)", flow_samples);
    percentiles("rejection", reject_samples);
}
