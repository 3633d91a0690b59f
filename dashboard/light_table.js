// The monitor's tables: rows as text in the page (never HTML), only the rows scrolled into view built,
// a heading click sorts (ascending, descending, as sent), "Download CSV" saves the rows in the order
// shown. Payload: dashboard/table_data.py (columnar; times as epoch ms; links checked there). el and
// fmtTime: component_base.js.

const ROW_H = 28;
const OVERSCAN = 8;
const NUMBER_FORMATS = {};

function isoTime(ms) {
  return new Date(ms).toISOString();
}

function numberFormat(digits) {
  if (!NUMBER_FORMATS[digits]) {
    NUMBER_FORMATS[digits] = new Intl.NumberFormat("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }
  return NUMBER_FORMATS[digits];
}

function safeHref(v) {
  return typeof v === "string" && /^https?:\/\/[^\s]+$/i.test(v) ? v : null;
}

// what a cell shows, per column (the values stay as sent for sorting and the CSV)
function shown(col, vals) {
  const none = col.empty || "";
  if (col.kind === "number") { const f = numberFormat(col.digits || 0); return vals.map((v) => (v === null ? none : f.format(v))); }
  if (col.kind === "time") return vals.map((v) => (v === null ? none : fmtTime(v)));
  if (col.kind === "link") return vals.map((v) => (v === null ? none : col.link_text || v));
  return vals.map((v) => (v === null ? none : String(v)));
}

function csvCell(col, v) {
  if (v === null || v === undefined) return "";
  let s = col.kind === "time" ? isoTime(v) : String(v);
  if (col.kind === "text" && /^[=+\-@\t\r]/.test(s)) s = "'" + s; // no formula when opened in a spreadsheet
  return /[",\r\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
}

function compare(vals, dir) {
  return (a, b) => {
    const x = vals[a], y = vals[b];
    if (x === y) return a - b;
    if (x === null) return 1; // empty cells last either way
    if (y === null) return -1;
    return (x < y ? -1 : 1) * dir;
  };
}

function build(host, data) {
  // newer rows for the same table (the page's next read) keep the reader's sort and scroll
  const kept = host.querySelector(".lt-table-scroll");
  const keptTop = kept ? kept.scrollTop : 0;
  host.replaceChildren();
  host.removeAttribute("data-drawn");
  const cols = data.columns, n = data.n;
  host.setAttribute("data-rows", String(n));
  host.setAttribute("aria-label", data.title);
  const cells = cols.map((c, i) => shown(c, data.data[i]));
  // the sort is kept on the host by column name, so newer rows for the same table keep it
  let order = Array.from({ length: n }, (_, i) => i);
  const sortCol = () => (host.ltSort ? cols.findIndex((c) => c.name === host.ltSort.name) : -1);
  function sortBy(i, dir) {
    host.ltSort = dir ? { name: cols[i].name, dir } : null;
    order = Array.from({ length: n }, (_, k) => k);
    if (dir) order.sort(compare(data.data[i], dir));
  }

  const bar = el("div", "lt-table-bar");
  bar.appendChild(el("span", "lt-table-count", `${n.toLocaleString("en-US")} ${n === 1 ? "row" : "rows"}`));
  const csv = el("button", "lt-table-csv", "Download CSV");
  csv.type = "button";
  csv.addEventListener("click", () => {
    const lines = [cols.map((c) => csvCell({ kind: "text" }, c.name)).join(",")];
    for (const r of order) lines.push(cols.map((c, i) => csvCell(c, data.data[i][r])).join(","));
    const url = URL.createObjectURL(new Blob(["\ufeff" + lines.join("\r\n") + "\r\n"], { type: "text/csv;charset=utf-8" }));
    const a = el("a");
    a.href = url; a.download = data.file || "table.csv";
    document.body.appendChild(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  });
  bar.appendChild(csv);
  host.appendChild(bar);
  if (!n) { host.appendChild(el("div", "lt-table-empty", "No rows.")); host.setAttribute("data-drawn", ""); return; }

  // widths from the longest texts of the heading and the first rows, measured in the table's font
  // (a column grows to fill the table; past 420 px a cell ends in an ellipsis, its text on hover)
  const ctx = document.createElement("canvas").getContext("2d");
  const font = getComputedStyle(host).font;
  const widths = cols.map((c, i) => {
    const vals = cells[i];
    const longest = [];
    for (let r = 0; r < Math.min(n, 300); r++) longest.push(vals[r]);
    longest.sort((a, b) => b.length - a.length);
    ctx.font = font;
    let w = longest.slice(0, 3).reduce((m, t) => Math.max(m, ctx.measureText(t).width), 0);
    ctx.font = "600 " + font;
    w = Math.max(w, ctx.measureText(c.label).width + 14); // room for the sort mark
    return Math.min(420, Math.max(48, Math.ceil(w + 20)));
  });
  const template = widths.map((w) => `minmax(${w}px, 1fr)`).join(" ");
  const scroll = el("div", "lt-table-scroll");
  scroll.setAttribute("role", "table");
  scroll.setAttribute("aria-label", data.title);
  scroll.setAttribute("aria-rowcount", String(n + 1));
  scroll.style.maxHeight = `${(Math.min(n, data.rows_shown || 10) + 1) * ROW_H + 2}px`;
  const inner = el("div", "lt-table-inner");
  inner.style.minWidth = `${widths.reduce((a, b) => a + b, 0)}px`;
  inner.style.height = `${(n + 1) * ROW_H}px`;
  inner.style.setProperty("--lt-cols", template);
  const head = el("div", "lt-tr lt-thead");
  head.setAttribute("role", "row");
  const heads = cols.map((c, i) => {
    const h = el("button", "lt-th" + (c.kind === "number" ? " lt-num" : ""), c.label);
    h.type = "button";
    h.setAttribute("role", "columnheader");
    h.title = `Sort by ${c.label}`;
    h.addEventListener("click", () => {
      const dir = sortCol() === i ? host.ltSort.dir : 0;
      sortBy(i, dir === 1 ? -1 : dir === -1 ? 0 : 1);
      marks();
      rows.replaceChildren(); first = -1;
      paint();
    });
    head.appendChild(h);
    return h;
  });
  function marks() {
    const at = sortCol();
    heads.forEach((x, k) => x.setAttribute("aria-sort", k === at ? (host.ltSort.dir === 1 ? "ascending" : "descending") : "none"));
  }
  const before = sortCol();
  if (before >= 0) sortBy(before, host.ltSort.dir);
  else host.ltSort = null; // that column is gone from the newer rows
  marks();
  const rows = el("div", "lt-rows");
  inner.appendChild(head);
  inner.appendChild(rows);
  scroll.appendChild(inner);
  host.appendChild(scroll);

  let first = -1, last = -1;
  function paint() {
    const top = Math.max(0, Math.floor(scroll.scrollTop / ROW_H) - OVERSCAN);
    const bottom = Math.min(n, Math.ceil((scroll.scrollTop + (scroll.clientHeight || 11 * ROW_H)) / ROW_H) + OVERSCAN);
    if (top === first && bottom === last) return;
    first = top; last = bottom;
    const frag = document.createDocumentFragment();
    for (let k = top; k < bottom; k++) {
      const r = order[k];
      const tr = el("div", "lt-tr");
      tr.setAttribute("role", "row");
      tr.setAttribute("aria-rowindex", String(k + 2));
      tr.style.top = `${(k + 1) * ROW_H}px`;
      cols.forEach((c, i) => {
        const text = cells[i][r];
        let td;
        const href = c.kind === "link" ? safeHref(data.data[i][r]) : null;
        if (href) {
          td = el("div", "lt-td");
          const a = el("a", null, text);
          a.href = href; a.target = "_blank"; a.rel = "noopener noreferrer";
          td.appendChild(a);
        } else {
          td = el("div", "lt-td" + (c.kind === "number" ? " lt-num" : ""), text);
          if (text.length > 24) td.title = text;
        }
        td.setAttribute("role", "cell");
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    }
    rows.replaceChildren(frag);
  }
  let queued = false;
  scroll.addEventListener("scroll", () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; paint(); });
  });
  if (keptTop) scroll.scrollTop = keptTop;
  paint();
  host.setAttribute("data-drawn", "");
}

export default function (component) {
  const { parentElement } = component;
  let host = parentElement.querySelector(".lt-table");
  if (!host) { host = el("div", "lt-table"); parentElement.appendChild(host); }
  const sig = sigOf(component.data);
  if (sig && host.ltSig === sig) return; // a rerun sending the same table keeps it as drawn (sort, scroll)
  host.ltSig = sig;
  build(host, unpack(component.data));
}
