//! Human formatting for kvctl's text output: byte sizes, ages, and aligned tables.
//!
//! [`Table`] collects rows of cells and writes them with every column padded to its widest cell
//! (the last column unpadded), so that output stays aligned whatever the values.

use std::io::{self, Write};
use std::time::Duration;

/// `1536` -> `1.5 KiB`; exact bytes below 1 KiB.
pub fn bytes(value: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if value < 1024 {
        return format!("{value} B");
    }
    let mut scaled = value as f64 / 1024.0;
    let mut unit = 0;
    while scaled >= 1024.0 && unit + 1 < UNITS.len() {
        scaled /= 1024.0;
        unit += 1;
    }
    format!("{scaled:.1} {}", UNITS[unit])
}

/// A short age: `850 us`, `12.3 ms`, `4.2 s`, `3.0 min`, `2.5 h`.
pub fn age(duration: Duration) -> String {
    let seconds = duration.as_secs_f64();
    if seconds < 1e-3 {
        format!("{} us", duration.as_micros())
    } else if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else if seconds < 3600.0 {
        format!("{:.1} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

/// A fraction as a percentage with one decimal, or `-` when undefined.
pub fn percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "-".to_owned(), |fraction| format!("{:.1}%", fraction * 100.0))
}

/// An optional value, `-` when absent.
pub fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| value.to_string())
}

/// Rows of cells written with aligned columns.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table whose first row is `header`.
    pub fn new(header: &[&str]) -> Table {
        Table { rows: vec![header.iter().map(|cell| (*cell).to_owned()).collect()] }
    }

    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// Writes every row, columns separated by two spaces, trailing spaces trimmed.
    pub fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|column| {
                self.rows
                    .iter()
                    .filter_map(|row| row.get(column))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for row in &self.rows {
            let mut line = String::new();
            for (column, cell) in row.iter().enumerate() {
                if column > 0 {
                    line.push_str("  ");
                }
                line.push_str(cell);
                let pad = widths[column].saturating_sub(cell.chars().count());
                line.extend(std::iter::repeat(' ').take(pad));
            }
            writeln!(out, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn ages_pick_a_readable_unit() {
        assert_eq!(age(Duration::from_micros(850)), "850 us");
        assert_eq!(age(Duration::from_micros(12_300)), "12.3 ms");
        assert_eq!(age(Duration::from_millis(4_200)), "4.2 s");
        assert_eq!(age(Duration::from_secs(180)), "3.0 min");
    }

    #[test]
    fn table_columns_line_up() {
        let mut table = Table::new(&["NAME", "STATE"]);
        table.push(vec!["a-long-name".into(), "live".into()]);
        table.push(vec!["b".into(), "stale".into()]);
        let mut out = Vec::new();
        table.write(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text, "NAME         STATE\na-long-name  live\nb            stale\n");
    }
}
