//! The PNG of RunPodSandbox latency per pod: one series per endpoint, drawn
//! by plotters into an RGB buffer, written as an indexed (palette) PNG,
//! which keeps a 1000×500 plot of 400 points near 100 KB. Text is set in a
//! TrueType font read at run time (DejaVu Sans from Debian's
//! `fonts-dejavu-core`, see `hack/deps.sh`). The numbers go beside it as
//! CSV, from which `--replot` draws it again.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use cubelet_e2e::{ms, percentile};

/// Debian's DejaVu Sans (`fonts-dejavu-core`).
pub(crate) const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Size of the PNG, pixels.
const SIZE: (u32, u32) = (1000, 500);

/// Okabe–Ito colours: told apart by every kind of colour vision.
const COLOURS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
];

/// One endpoint's series: its label and a value (ms) per pod.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Series {
    /// Endpoint label.
    pub(crate) label: String,
    /// Milliseconds, pod by pod.
    pub(crate) ms: Vec<f64>,
}

impl Series {
    /// The median, for the legend.
    fn p50(&self) -> Duration {
        let mut v: Vec<Duration> = self
            .ms
            .iter()
            .map(|m| Duration::from_secs_f64(m.max(0.0) / 1000.0))
            .collect();
        v.sort();
        percentile(&v, 50.0)
    }
}

/// Makes the font at `path` plotters' "sans-serif". Once per process.
pub(crate) fn load_font(path: &Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "read font {} (install fonts-dejavu-core, or pass --font)",
            path.display()
        )
    })?;
    // plotters keeps registered fonts for the whole process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{} is not a TrueType font", path.display()))
}

/// Draws `series` into the PNG at `out`, titled `title`.
pub(crate) fn draw(out: &Path, title: &str, series: &[Series]) -> anyhow::Result<()> {
    let (w, h) = SIZE;
    let mut rgb = vec![255u8; (w * h * 3) as usize];
    render(&mut rgb, title, series).map_err(|e| anyhow!("plot {}: {e}", out.display()))?;
    write_indexed_png(out, w, h, &rgb)
}

fn render(rgb: &mut [u8], title: &str, series: &[Series]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let pods = series.iter().map(|s| s.ms.len()).max().unwrap_or(0).max(2);
    let top = series
        .iter()
        .flat_map(|s| s.ms.iter().copied())
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.08;
    let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(1..pods, 0.0..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("pod, in the order created")
        .y_desc("RunPodSandbox (ms)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .bold_line_style(RGBColor(225, 225, 225))
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let points = s.ms.iter().enumerate().map(|(k, &v)| (k + 1, v));
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(1)))
            .map_err(|e| err(&e))?
            .label(format!("{} (p50 {} ms)", s.label, ms(s.p50())))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(3))
            });
        chart
            .draw_series(points.map(|p| Circle::new(p, 2, colour.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// The 256 most used colours of `rgb` and each pixel's index among them
/// (a colour not among them takes the nearest): lossless for a plot's few
/// colours, the rare antialiasing shades of its text aside.
fn quantize(rgb: &[u8]) -> (Vec<[u8; 3]>, Vec<u8>) {
    let pixel = |p: &[u8]| [p[0], p[1], p[2]];
    let mut counts: HashMap<[u8; 3], u32> = HashMap::new();
    for p in rgb.chunks_exact(3) {
        *counts.entry(pixel(p)).or_default() += 1;
    }
    let mut by_use: Vec<([u8; 3], u32)> = counts.into_iter().collect();
    by_use.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let palette: Vec<[u8; 3]> = by_use.iter().take(256).map(|(c, _)| *c).collect();
    let mut index: HashMap<[u8; 3], u8> = palette
        .iter()
        .zip(0..=u8::MAX)
        .map(|(c, i)| (*c, i))
        .collect();
    let nearest = |c: [u8; 3]| -> u8 {
        let d = |p: &[u8; 3]| -> i32 {
            (0..3)
                .map(|k| (i32::from(p[k]) - i32::from(c[k])).pow(2))
                .sum()
        };
        palette
            .iter()
            .zip(0..=u8::MAX)
            .min_by_key(|(p, _)| d(p))
            .map_or(0, |(_, i)| i)
    };
    let indices = rgb
        .chunks_exact(3)
        .map(|p| *index.entry(pixel(p)).or_insert_with(|| nearest(pixel(p))))
        .collect();
    (palette, indices)
}

fn write_indexed_png(out: &Path, w: u32, h: u32, rgb: &[u8]) -> anyhow::Result<()> {
    let (palette, indices) = quantize(rgb);
    let file = std::fs::File::create(out).with_context(|| format!("create {}", out.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Indexed);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_palette(palette.concat());
    enc.set_compression(png::Compression::High);
    let mut writer = enc.write_header()?;
    writer.write_image_data(&indices)?;
    writer.finish()?;
    Ok(())
}

/// The series as CSV: `pod,<label>,…`, a row per pod, ms (empty where a
/// series is shorter).
pub(crate) fn to_csv(series: &[Series]) -> String {
    let mut out = String::from("pod");
    for s in series {
        out.push(',');
        out.push_str(&s.label);
    }
    out.push('\n');
    let rows = series.iter().map(|s| s.ms.len()).max().unwrap_or(0);
    for k in 0..rows {
        out.push_str(&(k + 1).to_string());
        for s in series {
            out.push(',');
            if let Some(v) = s.ms.get(k) {
                out.push_str(&format!("{v:.3}"));
            }
        }
        out.push('\n');
    }
    out
}

/// Series back from [`to_csv`]'s text.
pub(crate) fn from_csv(text: &str) -> anyhow::Result<Vec<Series>> {
    let mut lines = text.lines();
    let header = lines.next().context("empty CSV")?;
    let mut series: Vec<Series> = header
        .split(',')
        .skip(1)
        .map(|l| Series {
            label: l.to_owned(),
            ms: Vec::new(),
        })
        .collect();
    if series.is_empty() {
        bail!("CSV header {header:?} names no series");
    }
    for (n, line) in lines.enumerate() {
        for (s, cell) in series.iter_mut().zip(line.split(',').skip(1)) {
            if !cell.is_empty() {
                s.ms.push(
                    cell.parse()
                        .with_context(|| format!("CSV line {}: {cell:?}", n + 2))?,
                );
            }
        }
    }
    Ok(series)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_small_png_with_text() {
        if !Path::new(DEFAULT_FONT).exists() {
            println!("SKIP: no {DEFAULT_FONT} (apt-get install fonts-dejavu-core)");
            return;
        }
        load_font(Path::new(DEFAULT_FONT)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.png");
        let series = vec![
            Series {
                label: "a".into(),
                ms: (0..200).map(|i| 50.0 + f64::from(i % 37)).collect(),
            },
            Series {
                label: "b".into(),
                ms: (0..200).map(|i| 20.0 + f64::from(i % 11)).collect(),
            },
        ];
        draw(&out, "test", &series).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() < 200_000, "{} bytes", bytes.len());
    }

    #[test]
    fn quantize_keeps_the_most_used_colours_and_maps_the_rest_to_the_nearest() {
        let mut rgb = Vec::new();
        // 256 reds used twice each, then 44 shades once: [j, 1, 0].
        for i in 0..=255u8 {
            rgb.extend_from_slice(&[i, 0, 0, i, 0, 0]);
        }
        for j in 0..44u8 {
            rgb.extend_from_slice(&[j, 1, 0]);
        }
        let (palette, idx) = quantize(&rgb);
        assert_eq!(palette.len(), 256);
        assert!(palette.iter().all(|c| c[1] == 0), "{palette:?}");
        assert_eq!(idx.len(), rgb.len() / 3);
        for (j, &i) in (0..44u8).zip(&idx[512..]) {
            assert_eq!(palette[usize::from(i)], [j, 0, 0]);
        }
        let (palette, idx) = quantize(&[1, 2, 3, 1, 2, 3, 9, 9, 9]);
        assert_eq!(palette, vec![[1, 2, 3], [9, 9, 9]]);
        assert_eq!(idx, vec![0, 0, 1]);
    }

    #[test]
    fn csv_round_trips() {
        let series = vec![
            Series {
                label: "containerd".into(),
                ms: vec![1.5, 2.25],
            },
            Series {
                label: "cubelet".into(),
                ms: vec![3.0],
            },
        ];
        let csv = to_csv(&series);
        assert_eq!(csv, "pod,containerd,cubelet\n1,1.500,3.000\n2,2.250,\n");
        assert_eq!(from_csv(&csv).unwrap(), series);
        assert!(from_csv("pod\n").is_err());
    }
}
