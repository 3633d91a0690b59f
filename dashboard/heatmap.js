// The hour x weekday load heatmap: a table of 7 x 24 shaded cells, each saying what it holds (title,
// aria-label, data-*), and a legend. Payload: dashboard/heatmap_table.py. Every text is set as text.
// el, pad2, drawOnce: component_base.js.

export default function (component) {
  drawOnce(component, "lh-box", (box, p) => {
    const table = el("table", "lh-heat");
    table.setAttribute("role", "table");
    table.setAttribute("aria-label", "held load by hour of day and weekday (UTC)");
    const head = el("tr");
    head.appendChild(el("th", "lh-day"));
    for (let h = 0; h < 24; h++) head.appendChild(el("th", null, h % 3 === 0 ? String(h) : ""));
    const thead = el("thead");
    thead.appendChild(head);
    const body = el("tbody");
    for (const row of p.rows) {
      const tr = el("tr");
      tr.appendChild(el("th", "lh-day", row.day));
      row.cells.forEach((c, hour) => {
        const td = el("td");
        if (c === null) {
          td.style.background = p.empty;
          td.title = `${row.day} ${pad2(hour)}:00: not in the range`;
        } else {
          td.className = "lh-cell";
          td.style.background = c.colour;
          td.title = c.label;
          td.setAttribute("aria-label", c.label);
          td.dataset.weekday = row.day;
          td.dataset.hour = String(hour);
          td.dataset.busy = String(c.busy);
          td.dataset.gpus = String(c.gpus);
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
    table.append(thead, body);
    const legend = el("div", "lh-legend");
    const bar = el("span", "bar");
    bar.style.background = `linear-gradient(90deg, ${p.legend.join(", ")})`;
    legend.append(el("span", null, "avg runs holding a slot"), el("span", null, "0"), bar, el("span", null, p.top));
    box.replaceChildren(table, legend);
  });
}
