"""Reads an SVG of `meshtrain plot` and prints what test_plot.sh checks, one key=value a
line. Parsing it with ElementTree is itself the check that the file is well-formed XML (a
parse error exits 1). The plotted values are read back from the coordinates through each
panel's tick labels and grid lines, so a check on them checks the drawing, not the log.
Standard library only (Debian's /usr/bin/python3)."""
import math
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def number(label):
    """A tick label back to a number: 3e-4, 250k, 1.5M, 12."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    if label and label[-1] in scale:
        return float(label[:-1]) * scale[label[-1]]
    return float(label)


def linear(pairs):
    """value = f(coordinate) through the first and last (value, coordinate) tick."""
    (v0, c0), (v1, c1) = pairs[0], pairs[-1]
    return lambda c: v0 + (c - c0) * (v1 - v0) / (c1 - c0)


def rounded(v, span):
    """v to the digits the drawing holds: coordinates are written to 0.1 px, so a panel
    of a few hundred px tells values apart to about span/2000; span/200 is safe."""
    d = max(0, math.ceil(-math.log10(span / 200)))
    s = f"{v:.{d}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def points(el):
    return [tuple(float(t) for t in p.split(",")) for p in el.get("points", "").split()]


def main(path):
    root = ET.parse(path).getroot()
    assert root.tag == NS + "svg", root.tag
    text = lambda el: "".join(el.itertext())
    print("title=" + text(root.find(f".//{NS}text[@id='title']")))
    print("subtitle=" + text(root.find(f".//{NS}text[@id='subtitle']")))
    panels = root.findall(f".//{NS}g[@class='panel']")
    print("panels=" + " ".join(p.get("id").removeprefix("panel-") for p in panels))
    ymaps = {}
    for p in panels:
        ticks = []
        for g in p.findall(f"{NS}g[@class='ytick']"):
            ticks.append((number(text(g.find(NS + "text"))), float(g.find(NS + "line").get("y1"))))
        name = p.get("id").removeprefix("panel-")
        print(f"ticks.{name}=" + " ".join(text(g.find(NS + "text")) for g in p.findall(f"{NS}g[@class='ytick']")))
        ymaps[name] = (linear(ticks), abs(ticks[-1][0] - ticks[0][0]))
    xt = [(number(text(t)), float(t.get("x"))) for t in root.findall(f".//{NS}text[@class='xtick']")]
    print("xticks=" + " ".join(text(t) for t in root.findall(f".//{NS}text[@class='xtick']")))
    xmap = linear(xt)
    for line, panel in (("loss-line", "loss"), ("val-line", "loss"), ("lr-line", "lr"), ("tokens-line", "tokens")):
        el = root.find(f".//{NS}polyline[@id='{line}']")
        if el is None:
            print(f"points.{line}=none")
            continue
        pts = points(el)
        print(f"points.{line}={len(pts)}")
        ymap, span = ymaps[panel]
        print(f"values.{line}=" + " ".join(f"{round(xmap(x))}:{rounded(ymap(y), span)}" for x, y in pts))
    markers = root.findall(f".//{NS}circle[@class='val-marker']")
    print(f"markers={len(markers)}")
    legend = root.find(f".//{NS}g[@id='legend']")
    print("legend=" + "|".join(text(t) for t in legend.findall(NS + "text")))


if __name__ == "__main__":
    main(sys.argv[1])
