//! What the cluster benchmark prints and draws: the README tables and the chart.

use std::path::Path;

use serde_json::Value;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// `median (speed-up)`, or a dash where the scenario had no node (two-node clusters).
fn cell(median: &Value, speedup: &Value) -> String {
    if f(median) > 0.0 {
        format!("{:.2} ({:.1}x)", f(median), f(speedup))
    } else {
        "-".to_string()
    }
}

/// The README table: median pull time per node and its speed-up over the baseline.
pub fn table(report: &Value) -> String {
    let mut out = String::from(
        "| image | baseline (s) | Ferry, one by one (s) | Ferry, at once (s) | pull-through cache (s) | physical limit (s) | MiB from upstream: baseline / Ferry / cache |\n|---|---|---|---|---|---|---|\n",
    );
    let mib = |v: &Value| f(v) / (1u64 << 20) as f64;
    for r in report["results"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {:.2} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} |\n",
            r["image"].as_str().unwrap_or(""),
            f(&r["baseline"]["median_s"]),
            cell(
                &r["ferry"]["one_by_one_median_s"],
                &r["ferry"]["speedup_one_by_one"]
            ),
            cell(
                &r["ferry"]["at_once_median_s"],
                &r["ferry"]["speedup_at_once"]
            ),
            cell(
                &r["pull_through_cache"]["rest_median_s"],
                &r["pull_through_cache"]["speedup"]
            ),
            cell(
                &r["physical_limit"]["median_s"],
                &r["physical_limit"]["speedup"]
            ),
            mib(&r["baseline"]["upstream_bytes"]),
            mib(&r["ferry"]["upstream_bytes"]),
            mib(&r["pull_through_cache"]["upstream_bytes"]),
        ));
    }
    out
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**missed**" }
}

/// The README table of component figures, each beside its target.
pub fn components(report: &Value) -> String {
    let c = &report["components"];
    let p = |v: &Value, ptr: &str| f(v.pointer(ptr).unwrap_or(&Value::Null));
    let mib = |kib: f64| kib / 1024.0;
    let size = p(c, "/throughput/blob_bytes") / (1u64 << 20) as f64;
    let t = &c["throughput"];
    let m = &c["memory"];
    let rows = [
        (
            format!(
                "exec to hosts.toml written (median / p99 of {})",
                c["startup"]["starts"]
            ),
            format!(
                "{:.1} / {:.1} ms",
                p(c, "/startup/hosts_written_ms/median"),
                p(c, "/startup/hosts_written_ms/p99")
            ),
            "under 50 ms median".to_string(),
            verdict(p(c, "/startup/hosts_written_ms/median") < 50.0),
        ),
        (
            "exec to `/readyz` 200 (median / p99)".to_string(),
            format!(
                "{:.1} / {:.1} ms",
                p(c, "/startup/readyz_ms/median"),
                p(c, "/startup/readyz_ms/p99")
            ),
            "under 50 ms median".to_string(),
            verdict(p(c, "/startup/readyz_ms/median") < 50.0),
        ),
        (
            format!("local blob serve, Ferry vs nginx `sendfile on`, {size:.0} MiB blob"),
            format!(
                "{:.0} vs {:.0} MiB/s: {:.2}x",
                f(&t["ferry_local_mib_s"]),
                f(&t["nginx_local_mib_s"]),
                f(&t["local_ratio"])
            ),
            "at least 0.8x".to_string(),
            verdict(f(&t["local_ratio"]) >= 0.8),
        ),
        (
            "two Ferry hops (other node's mirror, then this node's peer address) vs local nginx"
                .to_string(),
            format!(
                "{:.0} MiB/s: {:.2}x ({:.2}x of nginx across the same bridge, {:.0} MiB/s)",
                f(&t["ferry_two_hops_mib_s"]),
                f(&t["two_hops_ratio"]),
                f(&t["two_hops_ratio_same_path"]),
                f(&t["nginx_across_bridge_mib_s"])
            ),
            "at least 0.7x".to_string(),
            verdict(f(&t["two_hops_ratio"]) >= 0.7),
        ),
        (
            format!(
                "provider lookup (median / p99 of {} found, {} not found)",
                c["lookup"]["found"], c["lookup"]["missed"]
            ),
            format!(
                "{:.2} / {:.2} ms",
                p(c, "/lookup/ms/median"),
                p(c, "/lookup/ms/p99")
            ),
            "under 5 ms median".to_string(),
            verdict(p(c, "/lookup/ms/median") < 5.0 && p(c, "/lookup/found") > 0.0),
        ),
        (
            "resident memory, idle".to_string(),
            format!("{:.1} MiB", mib(f(&m["idle_kib"]))),
            "under 30 MiB".to_string(),
            verdict(mib(f(&m["idle_kib"])) < 30.0),
        ),
        (
            format!(
                "resident memory, {} digests advertised (settled; peak while advertising)",
                m["advertising_10k_digests"]["digests"]
            ),
            format!(
                "{:.1} MiB ({:.1} MiB; {:.0} s to advertise)",
                mib(p(m, "/advertising_10k_digests/settled_kib")),
                mib(p(m, "/advertising_10k_digests/peak_kib")),
                p(m, "/advertising_10k_digests/advertise_s")
            ),
            "-".to_string(),
            "",
        ),
        (
            format!("resident memory, serving four concurrent {size:.0} MiB pulls (peak)"),
            format!(
                "{:.1} MiB (receiving nodes: {:.1} MiB)",
                mib(p(m, "/serving_four_pulls/serving_peak_kib")),
                mib(p(m, "/serving_four_pulls/receiving_peak_kib"))
            ),
            "under 64 MiB".to_string(),
            verdict(mib(p(m, "/serving_four_pulls/serving_peak_kib")) < 64.0),
        ),
    ];
    let mut out = String::from("| component | measured | target | |\n|---|---|---|---|\n");
    for (what, measured, target, ok) in rows {
        out.push_str(&format!("| {what} | {measured} | {target} | {ok} |\n"));
    }
    out
}

/// The charts' font (plotters draws no text without one registered).
pub fn register_font() {
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
        .expect("DejaVu Sans (fonts-dejavu-core)");
    let _ = plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    );
}

/// Speed-up over the baseline per image and scenario, as grouped bars, with the 5x target:
/// ratios, because absolute times of 10 MiB and 1 GiB pulls do not share a scale.
pub fn chart(report: &Value, path: &Path) {
    const TARGET: f64 = 5.0;
    use plotters::prelude::*;
    register_font();
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let series = [
        (
            "Ferry, one by one",
            "/ferry/speedup_one_by_one",
            RGBColor(30, 120, 200),
        ),
        (
            "Ferry, at once",
            "/ferry/speedup_at_once",
            RGBColor(20, 170, 120),
        ),
        (
            "pull-through cache",
            "/pull_through_cache/speedup",
            RGBColor(230, 140, 30),
        ),
        (
            "physical limit (registry next door)",
            "/physical_limit/speedup",
            RGBColor(120, 80, 170),
        ),
    ];
    let max = results
        .iter()
        .flat_map(|r| {
            series
                .iter()
                .map(move |(_, p, _)| r.pointer(p).and_then(Value::as_f64).unwrap_or(0.0))
        })
        .fold(TARGET, f64::max);
    let root = BitMapBackend::new(path, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let n = results.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Speed-up of the median pull per node over the baseline (higher is better)",
            ("sans-serif", 24),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n, 0f64..max * 1.15)
        .unwrap();
    let labels: Vec<String> = results
        .iter()
        .map(|r| r["image"].as_str().unwrap_or("").to_string())
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        // Ticks every half unit: the label sits under the middle of each image's group.
        .x_labels(results.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            if (x.fract() - 0.5).abs() < 0.01 {
                labels.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("times faster than every node pulling from upstream")
        .draw()
        .unwrap();
    let width = 0.8 / series.len() as f64;
    for (s, (name, pointer, color)) in series.iter().enumerate() {
        let bars = results.iter().enumerate().map(|(i, r)| {
            let v = r.pointer(pointer).and_then(Value::as_f64).unwrap_or(0.0);
            let x0 = i as f64 + 0.1 + s as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, v)], color.filled())
        });
        chart
            .draw_series(bars)
            .unwrap()
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    let red = RGBColor(200, 30, 30);
    chart
        .draw_series(DashedLineSeries::new(
            [(0.0, TARGET), (n, TARGET)],
            8,
            6,
            red.stroke_width(2),
        ))
        .unwrap()
        .label("target: 5x")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], red.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .unwrap();
    root.present().unwrap();
}
