//! `gradsync-bench conv`: each pass of one 3x3 convolution (forward, input gradient, weight
//! gradient) on the CPU, by each way gradsync computes it: the direct kernels, Winograd
//! F(2x2, 3x3) and a column matrix with a GEMM. The figures behind the CPU's choice between
//! them (`GRADSYNC_CPU_CONV=auto`).

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use gradsync_core::device::{Backend, Cpu, Window};

use gradsync_compare::table::{Table, median};

/// Flags of `gradsync-bench conv`.
#[derive(Debug, Args)]
pub struct ConvArgs {
    /// Layers as CHANNELSxSIDE (input and output channels, square image side)
    #[arg(long, value_delimiter = ',', default_value = "64x32,128x16,256x8,512x4,512x2")]
    pub layers: Vec<String>,
    /// Batch size
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// CPU thread counts
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Rounds, the ways alternating within each so that drift hits all of them; the median
    /// round is reported
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// One layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layer {
    channels: usize,
    side: usize,
}

fn parse_layer(s: &str) -> anyhow::Result<Layer> {
    let bad = || format!("--layers: {s:?} is not CHANNELSxSIDE (for example 256x8)");
    let (c, h) = s.split_once('x').with_context(bad)?;
    let (channels, side) = (c.parse().with_context(bad)?, h.parse().with_context(bad)?);
    anyhow::ensure!(channels > 0 && side > 0, "{}: channels and side must be above 0", bad());
    Ok(Layer { channels, side })
}

/// The ways, in the order the table shows them.
const WAYS: [&str; 3] = ["direct", "winograd", "columns"];

/// Run `gradsync-bench conv`.
pub fn run(a: &ConvArgs) -> anyhow::Result<()> {
    let layers: Vec<Layer> = a.layers.iter().map(|s| parse_layer(s)).collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(a.batch > 0, "--batch must be above 0");
    anyhow::ensure!(a.rounds > 0, "--rounds must be above 0");
    let mut table = Table::new(&[
        "layer",
        "threads",
        "way",
        "forward ms",
        "input grad ms",
        "weight grad ms",
        "sum ms",
        "GFLOP/s",
        "vs columns",
    ]);
    for &threads in &a.threads {
        anyhow::ensure!(threads > 0, "--threads: 0 is not a thread count");
        let cpus: Vec<Cpu> = WAYS.iter().map(|w| Cpu::with_conv(threads, w)).collect::<Result<_, _>>()?;
        for layer in &layers {
            let times = time_layer(&cpus, *layer, a.batch, a.rounds)?;
            let flops = 3.0 * 2.0 * (layer.channels.pow(2) * 9 * layer.side.pow(2) * a.batch) as f64;
            let columns: f64 = times[2].iter().sum();
            for (way, t) in WAYS.iter().zip(&times) {
                let Some(sum) = t.iter().all(|v| v.is_finite()).then(|| t.iter().sum::<f64>()) else {
                    table.row(vec![
                        format!("{}x{}x{}", layer.channels, layer.side, layer.side),
                        threads.to_string(),
                        way.to_string(),
                        "not used here".into(),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                    ]);
                    continue;
                };
                table.row(vec![
                    format!("{}x{}x{}", layer.channels, layer.side, layer.side),
                    threads.to_string(),
                    way.to_string(),
                    format!("{:.1}", t[0]),
                    format!("{:.1}", t[1]),
                    format!("{:.1}", t[2]),
                    format!("{sum:.1}"),
                    format!("{:.1}", flops / (sum * 1e6)),
                    format!("{:.2}x", columns / sum),
                ]);
            }
        }
    }
    print!("{}", table.render());
    println!(
        "{} rounds, median per pass; batch {}; same input and output channels. GFLOP/s: the layer's multiply-adds \
         as a direct convolution counts them (Winograd performs 4/9 of them). \"not used here\": the direct \
         kernels need AVX-512F and at most 256 input channels. vs columns: the column matrix's sum over this way's.",
        a.rounds, a.batch
    );
    Ok(())
}

/// Median ms of each pass for each way (`[way][pass]`; infinite where the way does not apply).
fn time_layer(cpus: &[Cpu], layer: Layer, batch: usize, rounds: usize) -> anyhow::Result<Vec<[f64; 3]>> {
    let (c, side) = (layer.channels, layer.side);
    let win = Window { channels: c, height: side, width: side, kernel: 3, stride: 1, pad: 1 };
    let (cols, k) = (batch * side * side, c * 9);
    let values = |n: usize, step: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * step) % 17) as f32 / 17.0 - 0.5).collect()
    };
    let (x, w, dy) = (values(c * cols, 7), values(c * k, 5), values(c * cols, 3));
    let (mut y, mut dx, mut dw) = (vec![0.0; c * cols], vec![0.0; c * cols], vec![0.0; c * k]);
    let mut col: Vec<f32> = Vec::new();
    let mut runs: Vec<[Vec<f64>; 3]> = (0..cpus.len()).map(|_| Default::default()).collect();
    // One untimed round first: scratch memory, pages and caches.
    for round in 0..=rounds {
        for (way, (cpu, run)) in cpus.iter().zip(&mut runs).enumerate() {
            let direct = cpu.direct_conv(&win);
            if way < 2 && !direct {
                // This way does not apply here: the columns row times what it would fall back to.
                continue;
            }
            if !direct && col.is_empty() {
                col = vec![0.0; k * cols];
            }
            let mut pass =
                |i: usize, f: &mut dyn FnMut() -> gradsync_core::Result<()>| -> anyhow::Result<()> {
                    let t = Instant::now();
                    f()?;
                    if round > 0 {
                        run[i].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                    Ok(())
                };
            pass(0, &mut || {
                if direct {
                    cpu.conv(&mut y, &x, &w, &win, c, batch, false)
                } else {
                    cpu.im2col(&mut col, &x, &win, batch)?;
                    cpu.gemm(c, cols, k, &w, false, &col, false, &mut y, false)
                }
            })?;
            pass(1, &mut || {
                if direct {
                    cpu.conv_input_grad(&mut dx, &dy, &w, &win, c, batch, false)
                } else {
                    cpu.gemm(k, cols, c, &w, true, &dy, false, &mut col, false)?;
                    cpu.col2im(&mut dx, &col, &win, batch, false)
                }
            })?;
            pass(2, &mut || {
                if direct {
                    cpu.conv_weight_grad(&mut dw, &dy, &x, &win, c, batch, false)
                } else {
                    cpu.im2col(&mut col, &x, &win, batch)?;
                    cpu.gemm(c, k, cols, &dy, false, &col, true, &mut dw, false)
                }
            })?;
        }
    }
    Ok(cpus
        .iter()
        .zip(&runs)
        .enumerate()
        .map(|(i, (cpu, r))| {
            // The direct and Winograd ways fall back to the column matrix where they do not
            // apply: their rows would only repeat the columns row.
            if i < 2 && !cpu.direct_conv(&win) { [f64::INFINITY; 3] } else { r.clone().map(|v| median(&v)) }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_read_or_refused_by_name() {
        assert_eq!(parse_layer("256x8").unwrap(), Layer { channels: 256, side: 8 });
        for bad in ["256", "x8", "256x", "0x8", "256x0", "axb"] {
            let e = parse_layer(bad).unwrap_err().to_string();
            assert!(e.contains("--layers") && e.contains(bad), "{bad}: {e}");
        }
    }
}
