// Headline figures in a row: label (with an explanation on hover of its "?"), value. Every text is set
// as text, never as HTML. Payload: dashboard/figures.py (bytes). el, sigOf, unpack: component_base.js.

export default function (component) {
  const { parentElement } = component;
  const sig = sigOf(component.data);
  if (parentElement.lfSig === sig) return; // the same figures: leave them drawn
  const data = unpack(component.data);
  let row = parentElement.querySelector(".lf-row");
  if (!row) { row = el("div", "lf-row"); parentElement.appendChild(row); }
  row.style.gridTemplateColumns = `repeat(${data.columns || 4}, minmax(0, 1fr))`;
  row.replaceChildren(...data.figures.map((f) => {
    const cell = el("div", "lf-figure");
    cell.setAttribute("role", "group");
    cell.setAttribute("aria-label", f.label);
    const label = el("div", "lf-label");
    label.appendChild(el("span", null, f.label));
    if (f.help) {
      const help = el("span", "lf-help", "?");
      help.title = f.help;
      help.tabIndex = 0;
      help.setAttribute("aria-label", f.help);
      label.appendChild(help);
    }
    cell.appendChild(label);
    cell.appendChild(el("div", "lf-value", f.value));
    return cell;
  }));
  row.setAttribute("data-drawn", "");
  parentElement.lfSig = sig;
}
