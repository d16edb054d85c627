//! The pull phase (`--pulls N`): image pulls on every endpoint, alternating,
//! from a registry on this machine, with the image absent everywhere before
//! each measured pull. Endpoints on one containerd share its content store
//! (containerd's default `shared` content policy makes a blob another
//! namespace holds available without a download), so the image is removed
//! from every endpoint before each one is measured.
//!
//! Per endpoint and round: one cold PullImage, then `--pull-concurrency`
//! PullImage calls of the same image at once (the wall time until all have
//! answered). p50 of each, with the ratio to the baseline.

use std::time::{Duration, Instant};

use anyhow::Context;
use cubelet_e2e::cri::{PullImageRequest, RemoveImageRequest};
use cubelet_e2e::{image_spec, ms, percentile};

use crate::{progress, progress_done, rotation, Endpoint};

/// One endpoint's pull times.
#[derive(Debug, Default)]
struct Pulls {
    cold: Vec<Duration>,
    concurrent: Vec<Duration>,
}

/// Removes `image` from every endpoint (absent is fine).
async fn remove_everywhere(eps: &mut [Endpoint], image: &str) -> anyhow::Result<()> {
    for e in eps.iter_mut() {
        e.images
            .remove_image(RemoveImageRequest {
                image: Some(image_spec(image)),
            })
            .await
            .with_context(|| format!("{}: RemoveImage {image}", e.label))?;
    }
    Ok(())
}

/// `n` PullImage calls of `image` on `e` at once; the wall time until all
/// answered.
async fn pull_at_once(e: &Endpoint, image: &str, n: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let calls = (0..n).map(|_| {
        let mut images = e.images.clone();
        async move {
            images
                .pull_image(PullImageRequest {
                    image: Some(image_spec(image)),
                    ..Default::default()
                })
                .await
        }
    });
    for r in futures::future::join_all(calls).await {
        r.with_context(|| format!("{}: PullImage {image}", e.label))?;
    }
    Ok(started.elapsed())
}

/// Runs the phase and prints its table. The image is left absent on every
/// endpoint.
pub(crate) async fn pull_phase(
    eps: &mut [Endpoint],
    image: &str,
    rounds: usize,
    concurrency: usize,
    baseline: usize,
) -> anyhow::Result<()> {
    let mut out: Vec<Pulls> = eps.iter().map(|_| Pulls::default()).collect();
    for round in 0..rounds {
        for i in rotation(eps.len(), round) {
            remove_everywhere(eps, image).await?;
            out[i].cold.push(pull_at_once(&eps[i], image, 1).await?);
            remove_everywhere(eps, image).await?;
            out[i]
                .concurrent
                .push(pull_at_once(&eps[i], image, concurrency).await?);
        }
        progress(&format!("pull round {}/{rounds}", round + 1));
    }
    progress_done();
    remove_everywhere(eps, image).await?;

    for p in &mut out {
        p.cold.sort_unstable();
        p.concurrent.sort_unstable();
    }
    let p50 = |v: &[Duration]| percentile(v, 50.0);
    println!(
        "\ncri-bench pulls: {image}, {rounds} rounds per endpoint, alternating, absent everywhere before each pull; baseline {}\n",
        eps[baseline].label
    );
    println!("| pull (p50 ms) | cold, one caller | × baseline | {concurrency} callers at once (wall) | × baseline |");
    println!("|---|---|---|---|---|");
    let base = &out[baseline];
    for (e, p) in eps.iter().zip(&out) {
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "| {} | {} | {:.2} | {} | {:.2} |",
            e.label,
            ms(p50(&p.cold)),
            ratio(p50(&p.cold), p50(&base.cold)),
            ms(p50(&p.concurrent)),
            ratio(p50(&p.concurrent), p50(&base.concurrent)),
        );
    }
    Ok(())
}
