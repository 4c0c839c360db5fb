//! `cultnet-gateway report`: a picture (SVG, plotters) of a Persona's live session over time,
//! from her turn history (`STATE/personas/ID/turns.jsonl`):
//! 1. her prompt (prefix) against the policy's watermark and the model's window, with a marker
//!    and its reason for every refresh decision other than going on;
//! 2. the share of each prompt read from cache;
//! 3. the cost of each turn, and of what her session cost between turns (keep-warm
//!    refreshes, compactions, checkpoints);
//! 4. the cumulative cost, all of it, against what rebuilding the prompt every turn would have
//!    cost.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::turns::{RecordKind, TurnRecord};

/// Why a report could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// No turns to draw.
    #[error("no turns in the history")]
    Empty,
    /// The drawing failed.
    #[error("drawing the report: {0}")]
    Draw(String),
}

fn draw_err<E: std::fmt::Display>(e: E) -> ReportError {
    ReportError::Draw(e.to_string())
}

/// The series every report draws, by their legend names.
pub const SERIES: [&str; 9] = [
    "prefix",
    "watermark",
    "window",
    "refresh decision (and its reason)",
    "cache hit ratio",
    "cost of the turn",
    "between turns: refresh, compaction, checkpoint",
    "live session",
    "rebuilding the prompt every turn (estimate)",
];

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One panel: its caption, time across (in `unit`), 0 to `y_max` up, y labels by `y_label`.
fn panel<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    caption: &str,
    unit: &str,
    x_max: f64,
    y_max: f64,
    y_label: &dyn Fn(&f64) -> String,
) -> Result<Chart<'a, 'b>, ReportError> {
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(draw_err)?;
    c.configure_mesh()
        .x_desc(unit)
        .y_label_formatter(y_label)
        .draw()
        .map_err(draw_err)?;
    Ok(c)
}

/// The panel's legend box at `at`.
fn legend<'a, 'b: 'a>(c: &mut Chart<'a, 'b>, at: SeriesLabelPosition) -> Result<(), ReportError> {
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(at)
        .draw()
        .map_err(draw_err)
}

/// Picture width and height.
pub const SIZE: (u32, u32) = (1200, 1400);

/// The report of `persona`'s history (`records`, oldest first) as SVG text.
pub fn svg(persona: &str, records: &[TurnRecord]) -> Result<String, ReportError> {
    let upkeep: Vec<&TurnRecord> = records
        .iter()
        .filter(|r| r.kind != RecordKind::Turn)
        .collect();
    let turns: Vec<TurnRecord> = records
        .iter()
        .filter(|r| r.kind == RecordKind::Turn)
        .cloned()
        .collect();
    let turns = &turns[..];
    let first = turns.first().ok_or(ReportError::Empty)?;
    let t0 = records.first().map_or(first.at_ms, |r| r.at_ms);
    let span_ms = records.iter().map(|r| r.at_ms - t0).max().unwrap_or(0);
    // Time since her first turn in the history: hours, or minutes for a short history.
    let (unit_ms, unit) = if span_ms >= 2 * 3_600_000 {
        (3_600_000.0, "hours")
    } else {
        (60_000.0, "minutes")
    };
    let hours = |r: &TurnRecord| (r.at_ms - t0) as f64 / unit_ms;
    let x_max = records.iter().map(hours).fold(0.0_f64, f64::max).max(1e-3) * 1.02;
    let total: f64 = records.iter().map(|r| r.cost_usd).sum();
    let between: f64 = upkeep.iter().map(|r| r.cost_usd).sum();
    let count = |k: RecordKind| upkeep.iter().filter(|r| r.kind == k).count();
    let between = if upkeep.is_empty() {
        String::new()
    } else {
        format!(
            " (${between:.4} between turns: {} refreshes, {} compactions, {} checkpoints)",
            count(RecordKind::Refresh),
            count(RecordKind::Compaction),
            count(RecordKind::Checkpoint)
        )
    };
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (title, body) = root.split_vertically(50);
        title
            .titled(
                &format!(
                    "{persona}: {} turns over {:.1} {unit}, cost ${total:.4}{between}",
                    turns.len(),
                    x_max / 1.02,
                ),
                ("sans-serif", 26),
            )
            .map_err(draw_err)?;
        let panels = body.split_evenly((4, 1));

        // 1. Prefix, watermark, window, decisions.
        let y_max = turns
            .iter()
            .map(|r| r.window_tokens.max(r.prefix_tokens))
            .max()
            .unwrap_or(1) as f64
            * 1.05;
        let mut c = panel(&panels[0], "prompt tokens", unit, x_max, y_max, &|v| {
            format!("{:.0}k", v / 1000.0)
        })?;
        let series = |f: fn(&TurnRecord) -> f64| -> Vec<(f64, f64)> {
            turns.iter().map(|r| (hours(r), f(r))).collect()
        };
        c.draw_series(LineSeries::new(
            series(|r| r.prefix_tokens as f64),
            BLUE.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("prefix")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        c.draw_series(LineSeries::new(
            series(|r| r.watermark_tokens as f64),
            RGBColor(230, 140, 0).stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("watermark")
        .legend(|(x, y)| {
            PathElement::new(
                vec![(x, y), (x + 20, y)],
                RGBColor(230, 140, 0).stroke_width(2),
            )
        });
        c.draw_series(LineSeries::new(
            series(|r| r.window_tokens as f64),
            RED.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("window")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        let decisions: Vec<&TurnRecord> = turns
            .iter()
            .filter(|r| !r.decision.is_empty() && r.decision != "Continue")
            .collect();
        let color_of = |d: &str| {
            if d.starts_with("Compact") {
                RGBColor(0, 150, 0)
            } else if d.starts_with("FreshStart") {
                MAGENTA
            } else {
                RGBColor(120, 60, 0)
            }
        };
        // Each marker carries its reason while there are few; with many, the legend counts
        // them by decision and reason instead (labels would pile up).
        let labelled = decisions.len() <= 8;
        c.draw_series(decisions.iter().map(|r| {
            let color = color_of(&r.decision);
            let label = if labelled {
                r.decision.clone()
            } else {
                String::new()
            };
            EmptyElement::at((hours(r), r.prefix_tokens as f64))
                + TriangleMarker::new((0, 0), 8, color.filled())
                + Text::new(
                    label,
                    (6, -18),
                    ("sans-serif", 13).into_font().color(&color),
                )
        }))
        .map_err(draw_err)?
        .label("refresh decision (and its reason)")
        .legend(|(x, y)| TriangleMarker::new((x + 10, y), 6, MAGENTA.filled()));
        let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
        for r in &decisions {
            *kinds.entry(r.decision.as_str()).or_default() += 1;
        }
        for (decision, n) in kinds {
            let color = color_of(decision);
            c.draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
                .map_err(draw_err)?
                .label(format!("{decision} x{n}"))
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, color.filled()));
        }
        legend(&mut c, SeriesLabelPosition::UpperLeft)?;

        // 2. Cache hit share.
        let mut c = panel(
            &panels[1],
            "share of the prompt read from cache",
            unit,
            x_max,
            1.05,
            &|v| format!("{:.0}%", v * 100.0),
        )?;
        c.draw_series(LineSeries::new(
            series(|r| r.hit_ratio),
            BLUE.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("cache hit ratio")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        c.draw_series(
            turns
                .iter()
                .map(|r| Circle::new((hours(r), r.hit_ratio), 2, BLUE.filled())),
        )
        .map_err(draw_err)?;
        legend(&mut c, SeriesLabelPosition::LowerRight)?;

        // 3. Cost per turn, and between turns.
        let cost_max = records
            .iter()
            .map(|r| r.cost_usd)
            .fold(0.0_f64, f64::max)
            .max(1e-6)
            * 1.1;
        let mut c = panel(&panels[2], "cost per turn", unit, x_max, cost_max, &|v| {
            format!("${v:.3}")
        })?;
        c.draw_series(
            turns
                .iter()
                .map(|r| Circle::new((hours(r), r.cost_usd), 3, BLUE.filled())),
        )
        .map_err(draw_err)?
        .label("cost of the turn")
        .legend(|(x, y)| Circle::new((x + 10, y), 3, BLUE.filled()));
        let orange = RGBColor(230, 140, 0);
        c.draw_series(
            upkeep
                .iter()
                .map(|r| Cross::new((hours(r), r.cost_usd), 3, orange.stroke_width(1))),
        )
        .map_err(draw_err)?
        .label("between turns: refresh, compaction, checkpoint")
        .legend(move |(x, y)| Cross::new((x + 10, y), 3, orange.stroke_width(1)));
        legend(&mut c, SeriesLabelPosition::UpperLeft)?;

        // 4. Cumulative cost (turns and what came between them) against rebuilding every turn.
        let mut cum = Vec::with_capacity(records.len());
        let mut rebuild = Vec::with_capacity(records.len());
        let (mut a, mut b) = (0.0, 0.0);
        for r in records {
            a += r.cost_usd;
            b += r.rebuild_usd;
            cum.push((hours(r), a));
            rebuild.push((hours(r), b));
        }
        let y_max = a.max(b).max(1e-6) * 1.05;
        let mut c = panel(&panels[3], "cumulative cost", unit, x_max, y_max, &|v| {
            format!("${v:.2}")
        })?;
        c.draw_series(LineSeries::new(cum, BLUE.stroke_width(2)))
            .map_err(draw_err)?
            .label("live session")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        c.draw_series(LineSeries::new(rebuild, RED.stroke_width(2)))
            .map_err(draw_err)?
            .label("rebuilding the prompt every turn (estimate)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        legend(&mut c, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(draw_err)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 200-turn run as the turn loop records it: a prefix growing to the watermark, compacted
    /// twice and started fresh once, cache hits high except after each refresh.
    pub(crate) fn run(n: usize) -> Vec<TurnRecord> {
        let mut prefix = 24_000u64;
        (0..n)
            .map(|i| {
                let decision = match i {
                    70 | 150 => "Compact(ContextFull)",
                    110 => "FreshStart(SkiRental)",
                    _ => "Continue",
                };
                let fresh = decision != "Continue";
                prefix = match decision {
                    "Continue" => prefix + 1_100 + (i as u64 * 37) % 400,
                    d if d.starts_with("Compact") => 30_000,
                    _ => 24_500,
                };
                let hit = if fresh || i == 0 { 0.2 } else { 0.96 };
                let cost = prefix as f64 * 3e-6 * (hit * 0.1 + (1.0 - hit) * 2.0);
                TurnRecord {
                    at_ms: 1_800_000_000_000 + i as i64 * 600_000,
                    prefix_tokens: prefix,
                    watermark_tokens: 132_750,
                    window_tokens: 200_000,
                    hit_ratio: hit,
                    cost_usd: cost,
                    rebuild_usd: prefix as f64 * 3e-6 * 2.0,
                    decision: decision.to_owned(),
                    ..TurnRecord::default()
                }
            })
            .collect()
    }

    #[test]
    fn a_200_turn_run_is_valid_svg_with_every_series_and_decision() {
        let svg = svg("mira", &run(200)).unwrap();
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        let texts: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text())
            .map(str::trim)
            .collect();
        for want in SERIES {
            assert!(texts.contains(&want), "{want:?} missing: {texts:?}");
        }
        // A marker and its reason for each decision other than going on.
        assert_eq!(
            texts
                .iter()
                .filter(|t| **t == "Compact(ContextFull)")
                .count(),
            2
        );
        assert_eq!(
            texts
                .iter()
                .filter(|t| **t == "FreshStart(SkiRental)")
                .count(),
            1
        );
        assert!(
            texts
                .iter()
                .any(|t| t.starts_with("mira: 200 turns over 33.2 hours")),
            "{texts:?}"
        );
        // One line per series: three in the first panel, one in the second, two in the last.
        let lines = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .count();
        assert!(lines >= 6, "{lines} polylines");
        if let Ok(path) = std::env::var("REPORT_SVG") {
            std::fs::write(path, &svg).unwrap();
        }
        assert!(matches!(svg_err(), ReportError::Empty));
    }

    #[test]
    fn what_came_between_turns_is_in_the_cost_and_not_among_the_turns() {
        let mut records = run(4);
        let between = |kind, at_ms, cost_usd| TurnRecord {
            kind,
            at_ms,
            cost_usd,
            prefix_tokens: 90_000,
            ..TurnRecord::default()
        };
        let t = records[1].at_ms;
        records.insert(2, between(RecordKind::Refresh, t + 290_000, 0.5));
        records.insert(3, between(RecordKind::Compaction, t + 300_000, 0.25));
        let turns: f64 = run(4).iter().map(|r| r.cost_usd).sum();
        let drawn = svg("mira", &records).unwrap();
        let doc = roxmltree::Document::parse(&drawn).expect("well-formed SVG");
        let title = doc
            .descendants()
            .filter_map(|n| n.text())
            .map(str::trim)
            .find(|t| t.starts_with("mira:"))
            .unwrap_or_default()
            .to_owned();
        // Four turns, all six records' cost, and what came between them.
        assert!(title.starts_with("mira: 4 turns over "), "{title}");
        assert!(
            title.contains(&format!("cost ${:.4}", turns + 0.75))
                && title.contains("$0.7500 between turns: 1 refreshes, 1 compactions"),
            "{title}"
        );
        // Their cost is drawn as its own series.
        assert!(drawn.contains("between turns: refresh, compaction, checkpoint"));
        // A history of what came between turns alone has no turn to draw.
        assert!(matches!(
            svg("mira", &records[2..4]),
            Err(ReportError::Empty)
        ));
    }

    fn svg_err() -> ReportError {
        svg("mira", &[]).unwrap_err()
    }
}
