#!/usr/bin/env bash
# Builds the Linux installers from this checkout (after ./dev has set up .venv):
#   $OUT/runmyai-VERSION-linux-x86_64.tar.gz   self-contained: unpack anywhere and run ./runmyai
#   $OUT/runmyai_VERSION_amd64.deb             installs under /opt/runmyai, /usr/bin/{runmyai,tokenwing} links,
#                                              a desktop entry and an icon
# OUT is $RUNMYAI_DIST or dist/. Steps: native core, PyInstaller onedir bundle (installer/runmyai.spec) with the
# ggml build the engine uses (./dev builds it once, engine/ggml/build.sh: every x86-64 CPU level, Vulkan where it
# builds), checks on the bundle, tarball, .deb. Nothing is rebuilt when the inputs (the sources, the installed
# packages, the ggml build) hash the same as the last build's and its artifacts exist; RUNMYAI_REBUILD=1 forces a
# build.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export GGML_NO_BACKTRACE=1

OUT=${RUNMYAI_DIST:-dist}
WORK=build/installer
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
log() { echo "build-linux: $*" >&2; }
t0=$SECONDS

if ! python -c "import PyInstaller" 2>/dev/null; then  # the `installer` extra of pyproject.toml
  req=$(python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["installer"])')
  log "installing $req"
  python -m pip install -q $req
fi

VERSION=$(python -c 'import re; print(re.search(r"__version__ = \"(.+?)\"", open("engine/tokenwing/version.py").read())[1])')
TARBALL=$OUT/runmyai-$VERSION-linux-x86_64.tar.gz
DEB=$OUT/runmyai_${VERSION}_amd64.deb

GGML=${RUNMYAI_GGML:-$(python -c 'import sys; print(sys.prefix)')/lib/tokenwing-ggml}
[ -f "$GGML/lib/libggml.so.0" ] || { log "no ggml build in $GGML: run ./dev setup"; exit 1; }
levels=$(ls "$GGML/backends/cpu" | sed -n 's/^libggml-cpu-\(.*\)\.so$/\1/p' | paste -sd' ')
case " $levels " in
  *" x64 "*" haswell "*|*" haswell "*" x64 "*) ;;
  *) log "the ggml build in $GGML has the CPU levels '$levels' only (./dev demo builds this CPU's): the installers carry every level: run ./dev setup"; exit 1 ;;
esac
export RUNMYAI_GGML=$GGML

# The native core, built for the bundle from this checkout: Release, the compiler's x86-64 baseline (no
# -march=native, whatever CFLAGS/CXXFLAGS/CMAKE_ARGS say), incremental in build/installer/core.
log "native core"
env -u CFLAGS -u CXXFLAGS -u CPPFLAGS -u CMAKE_ARGS cmake -S engine/native -B "$WORK/core" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DPython_EXECUTABLE="$(command -v python)" >/dev/null
nice cmake --build "$WORK/core" >/dev/null
CORE=$(ls "$PWD/$WORK"/core/_core.*so)
! grep -qE -- '-march=|-mavx|-mtune=native' "$WORK/core/compile_commands.json" || { log "native flags in the core's build"; exit 1; }
export RUNMYAI_CORE=$CORE
inputs_key() {
  {
    { git ls-files -co --exclude-standard -- engine app installer resources presets pyproject.toml 2>/dev/null \
      || find engine app installer resources presets pyproject.toml -type f -not -path '*/__pycache__/*'; } \
      | LC_ALL=C sort | while read -r f; do if [ -f "$f" ]; then sha256sum "$f"; fi; done
    python -m pip freeze --exclude-editable 2>/dev/null
    python --version
    sha256sum "$CORE"
    cat "$GGML/build.key"
  } | sha256sum | cut -c1-16
}
KEY=$(inputs_key)
if [ -z "${RUNMYAI_REBUILD:-}" ] && [ "$(cat "$WORK/inputs.key" 2>/dev/null || true)" = "$KEY" ] \
  && [ -f "$TARBALL" ] && [ -f "$DEB" ] && [ -x "$WORK/dist/runmyai/tokenwing" ]; then
  log "up to date (inputs $KEY): $TARBALL $DEB"
  exit 0
fi
rm -f "$WORK/inputs.key"

# The native core must be portable (the venv's build uses no -march flags; check the code to be sure).
if objdump -d "$CORE" | grep -qE '%[yz]mm|%k[0-7]'; then
  log "the native core $CORE uses AVX/AVX-512 instructions"; exit 1
fi
# ggml's core and its x64 CPU backend run on any x86-64: no AVX registers in their code (the other CPU levels
# are loaded only where ggml's score says the CPU runs them)
for lib in "$GGML/lib/libggml-base.so.0" "$GGML/lib/libggml.so.0" "$GGML/backends/cpu/libggml-cpu-x64.so"; do
  if objdump -d "$lib" | grep -qE '%[yz]mm'; then log "$(basename "$lib") uses AVX instructions"; exit 1; fi
done

log "PyInstaller bundle"
s=$SECONDS
# (PyInstaller imports the engine's modules to collect them: they must find this ggml build, which may not be the
# venv's; the frozen programs run below find their own)
TOKENWING_GGML_DIR=$GGML nice python -m PyInstaller --noconfirm --log-level WARN --distpath "$WORK/dist" --workpath "$WORK/work" \
  installer/runmyai.spec
BUNDLE=$WORK/dist/runmyai
log "bundle built in $((SECONDS - s)) s: $(du -sh "$BUNDLE" | cut -f1)"

# ------------------------------------------------------------------------------------------------ checks
fail() { log "bundle check failed: $*"; exit 1; }
for exe in runmyai tokenwing; do [ -x "$BUNDLE/$exe" ] || fail "no $exe executable"; done
I=$BUNDLE/_internal
for f in PySide6/Qt/plugins/platforms/libqxcb.so PySide6/Qt/plugins/platforms/libqoffscreen.so \
  resources/icons/runmyai.png resources/runmyai.desktop presets tokenwing/"$(basename "$CORE")" \
  ggml/lib/libggml.so.0 ggml/lib/libggml-base.so.0 ggml/backends/cpu/libggml-cpu-x64.so \
  ggml/backends/cpu/libggml-cpu-haswell.so ggml/build.json; do
  [ -e "$I/$f" ] || fail "missing _internal/$f"
done
[ -d "$I/resources/demo-model" ] || log "warning: no resources/demo-model in this checkout (the built-in model)"
stray=$(find "$BUNDLE" -name 'libggml*' -not -path "$I/ggml/*")
[ -z "$stray" ] || fail "ggml libraries outside _internal/ggml/ (a second copy could load): $stray"
loader=$(find "$BUNDLE" -name 'libvulkan.so*')
[ -z "$loader" ] || fail "a Vulkan loader in the bundle (the user's system provides it, with its drivers): $loader"
for mod in llama_cpp torch pytest _pytest hypothesis openai PyInstaller; do
  [ ! -e "$I/$mod" ] || fail "$mod must not be bundled"
done
[ "$("$BUNDLE/tokenwing" --version)" = "tokenwing $VERSION" ] || fail "tokenwing --version"
[ "$("$BUNDLE/runmyai" --version)" = "runmyai $VERSION" ] || fail "runmyai --version"

# ------------------------------------------------------------------------------------------------ tarball
log "tarball"
STAGE=$WORK/pkg
rm -rf "$STAGE"
TOP=$STAGE/runmyai-$VERSION
mkdir -p "$TOP"
cp -a "$BUNDLE/." "$TOP/"
cp resources/runmyai.desktop "$TOP/runmyai.desktop"
cp resources/icons/runmyai.png "$TOP/runmyai.png"
cp installer/linux/install-desktop-entry.sh "$TOP/install-desktop-entry.sh"
cp installer/linux/README.txt "$TOP/README.txt"
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner --sort=name -cf - "runmyai-$VERSION" | gzip -6 >"$TARBALL.tmp"
mv "$TARBALL.tmp" "$TARBALL"

# ------------------------------------------------------------------------------------------------ .deb
log ".deb"
ROOTFS=$WORK/deb
rm -rf "$ROOTFS"
mkdir -p "$ROOTFS/opt" "$ROOTFS/usr/bin" "$ROOTFS/usr/share/applications" \
  "$ROOTFS/usr/share/icons/hicolor/256x256/apps" "$ROOTFS/usr/share/doc/runmyai" "$ROOTFS/DEBIAN"
cp -a "$BUNDLE" "$ROOTFS/opt/runmyai"
ln -s /opt/runmyai/runmyai "$ROOTFS/usr/bin/runmyai"
ln -s /opt/runmyai/tokenwing "$ROOTFS/usr/bin/tokenwing"
install -m 644 resources/runmyai.desktop "$ROOTFS/usr/share/applications/runmyai.desktop"
install -m 644 resources/icons/runmyai.png "$ROOTFS/usr/share/icons/hicolor/256x256/apps/runmyai.png"
printf 'Run My AI and TokenWing %s\nLicense: Apache-2.0\nThe bundled libraries keep their own licenses.\n' \
  "$VERSION" >"$ROOTFS/usr/share/doc/runmyai/copyright"
chmod -R u+rwX,go+rX,go-w "$ROOTFS"
# Depends: what Qt's xcb platform plugin and its libQt6XcbQpa link (libxcb-icccm4, libxcb-cursor0,
# libxkbcommon-x11-0 …), derived from their ELF NEEDED entries by Debian's own dpkg-shlibdeps (with the versions
# the symbols need), not from what the build machine happens to have: a library missing here fails the build.
# PyInstaller may carry some of them in the bundle; the system's are named anyway. Qt's own libraries are the
# bundle's (-l). libEGL for Qt's OpenGL; libc6 at the oldest glibc the bundle was checked on.
QT=$PWD/$I/PySide6/Qt
shl=$PWD/$WORK/shlibdeps
rm -rf "$shl" && mkdir -p "$shl/debian"
printf 'Source: runmyai\n\nPackage: runmyai\nArchitecture: amd64\n' >"$shl/debian/control"
xcb_depends=$(cd "$shl" && dpkg-shlibdeps -O -l"$QT/lib" --ignore-missing-info \
  "$QT/plugins/platforms/libqxcb.so" "$QT/lib/libQt6XcbQpa.so.6" 2>"$shl/warnings") \
  || { cat "$shl/warnings" >&2; log "dpkg-shlibdeps failed on Qt's xcb plugin: install its libraries (./dev test does)"; exit 1; }
xcb_depends=${xcb_depends#shlibs:Depends=}
[ -n "$xcb_depends" ] || { log "dpkg-shlibdeps named no library for Qt's xcb plugin"; exit 1; }
DEPENDS=$(echo "libc6 (>= 2.36), libegl1, $xcb_depends" | tr ',' '\n' | sed 's/^ *//' | awk '!/^libc6 / || !c++' | paste -sd, | sed 's/,/, /g')
rm -rf "$shl"
log "Depends: $DEPENDS"
cat >"$ROOTFS/DEBIAN/control" <<EOF
Package: runmyai
Version: $VERSION
Architecture: amd64
Maintainer: Run My AI <runmyai@localhost>
Installed-Size: $(du -sk "$ROOTFS" --exclude=DEBIAN | cut -f1)
Depends: $DEPENDS
Section: utils
Priority: optional
Homepage: https://localhost/runmyai
Description: chat with large language models on this computer
 Run My AI is a desktop app for running large Mixture-of-Experts language models
 locally. TokenWing, its engine (also usable on its own: tokenwing serve MODEL),
 streams the routed experts from the drive into RAM. Needs an x86-64 CPU with AVX2.
EOF
cat >"$ROOTFS/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  command -v update-desktop-database >/dev/null && update-desktop-database -q /usr/share/applications || true
  command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -f /usr/share/icons/hicolor || true
fi
exit 0
EOF
chmod 755 "$ROOTFS/DEBIAN/postinst"
nice dpkg-deb --build --root-owner-group -Zgzip -z6 "$ROOTFS" "$DEB.tmp" >/dev/null
mv "$DEB.tmp" "$DEB"
rm -rf "$STAGE" "$ROOTFS"

echo "$KEY" >"$WORK/inputs.key"
log "done in $((SECONDS - t0)) s: bundle $(du -sh "$BUNDLE" | cut -f1), $(basename "$TARBALL") $(du -h "$TARBALL" | cut -f1), $(basename "$DEB") $(du -h "$DEB" | cut -f1)"
