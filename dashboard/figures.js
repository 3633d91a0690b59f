// Headline figures in a row: label (with an explanation on hover of its "?"), value. Every text is set
// as text, never as HTML. Payload: dashboard/figures.py (bytes). el, helpIcon, drawOnce: component_base.js.

export default function (component) {
  drawOnce(component, "lf-row", (row, data) => {
    row.style.gridTemplateColumns = `repeat(${data.columns || 4}, minmax(0, 1fr))`;
    row.replaceChildren(...data.figures.map((f) => {
      const cell = el("div", "lf-figure");
      cell.setAttribute("role", "group");
      cell.setAttribute("aria-label", f.label);
      const label = el("div", "lf-label");
      label.appendChild(el("span", null, f.label));
      if (f.help) label.appendChild(helpIcon(f.help));
      cell.appendChild(label);
      cell.appendChild(el("div", "lf-value", f.value));
      return cell;
    }));
  });
}
