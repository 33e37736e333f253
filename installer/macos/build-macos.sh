#!/usr/bin/env bash
# Builds dist/runmyai-VERSION-macos-ARCH.dmg holding "Run My AI.app" (PyInstaller BUNDLE + hdiutil).
# NOT RUN on our (Linux) machines: written from the Linux build and PyInstaller's and hdiutil's documentation.
# Needs macOS 12+, Xcode command-line tools, Python 3.11-3.13, CMake. Build on the architecture you ship
# (arm64 on Apple Silicon; an Intel build on an Intel Mac gets the AVX2 flags below).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=24"
arch=$(uname -m)
python -m pip install -q -e ".[dev,installer]" pillow  # Pillow: PyInstaller turns the PNG icon into an .icns
# ggml from the pinned source with engine/ggml/CMakeLists.txt. Not yet ported: ggml cannot build every CPU level
# on macOS arm64 (GGML_CPU_ALL_VARIANTS), and build.sh lays out Linux's file names (docs/dependencies.md).
engine/ggml/build.sh "$VIRTUAL_ENV/lib/tokenwing-ggml"
version=$(python -c 'from tokenwing.version import __version__; print(__version__)')

python -m PyInstaller --noconfirm \
  --distpath build/installer/dist --workpath build/installer/work installer/runmyai.spec
app="build/installer/dist/Run My AI.app"
"$app/Contents/MacOS/tokenwing" --version

# Optional, needs an Apple Developer ID (unsigned apps must be opened with right-click > Open the first time):
#   codesign --deep --force --options runtime --sign "Developer ID Application: NAME (TEAM)" "$app"
#   xcrun notarytool submit DMG --keychain-profile PROFILE --wait && xcrun stapler staple DMG
stage=build/installer/dmg
rm -rf "$stage" && mkdir -p "$stage" dist
cp -R "$app" "$stage/"
ln -s /Applications "$stage/Applications"
hdiutil create -volname "Run My AI" -srcfolder "$stage" -ov -format UDZO "dist/runmyai-$version-macos-$arch.dmg"
echo "dist/runmyai-$version-macos-$arch.dmg"
