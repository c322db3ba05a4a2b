# The neuron-disagg AMIs: one for Trainium (from the latest Neuron DLAMI) and one for H200 / p5en
# (from the latest GPU DLAMI), each found through AWS's public SSM parameters so a rebuild starts
# from the current release (or from a pinned AMI id: neuron_source_ami / cuda_source_ami).
# Provisioning installs and verifies, in order: the EFA software (the pinned installer,
# GPG-checked, unless the DLAMI's is as new), RDMA memory limits, vLLM + NIXL + neuron-disagg,
# what NIXL's LIBFABRIC plugin needs besides libfabric (Trainium: libcuda stub, CUDA runtime,
# hwloc; H200: CUDA runtime, hwloc), the systemd units (and the model cache on local NVMe); the
# last step runs `neuron-disagg doctor --image --platform <neuron|cuda>` and fails the build if it
# fails. The builders are ordinary m6i instances (see neuron_instance_type for why). Each AMI is
# tagged with what it was built from: the source AMI's id and name, the EFA installer pin, NIXL.
#
#   ami/build.sh                       # builds the wheel, then `packer init` + `packer build` here
#   packer build -only='amazon-ebs.neuron' -var wheel=dist/neuron_disagg-0.1.0-py3-none-any.whl ami/
#
# `neuron-disagg launch` finds the result by its tag neuron-disagg:platform = neuron | cuda.

packer {
  required_plugins {
    amazon = {
      version = ">= 1.3.0"
      source  = "github.com/hashicorp/amazon"
    }
  }
}

variable "region" {
  type        = string
  default     = "us-east-2"
  description = "Region to build in; the AMI is usable there (copy it for others)."
}

variable "wheel" {
  type        = string
  description = "Path to the neuron_disagg wheel to install (ami/build.sh builds it into dist/)."
}

variable "package_version" {
  type        = string
  default     = "0.1.0"
  description = "Recorded in the AMI's tags."
}

variable "neuron_ssm_parameter" {
  type        = string
  default     = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
  description = "Public SSM parameter holding the Neuron DLAMI to start from (it must ship a vLLM environment)."
}

variable "cuda_ssm_parameter" {
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
  description = "Public SSM parameter holding the GPU DLAMI to start from."
}

# Pinning the DLAMI: AWS publishes only "latest" parameters for these DLAMIs (the Neuron DLAMI guide:
# SSM finds the latest DLAMI of each type; per-release parameters are "future"), so a versioned SSM
# path cannot pin one. An AMI id can (per region): set these to rebuild from a known DLAMI. Either
# way the AMI records its source in the tags neuron-disagg:source-ami and :source-ami-name.
variable "neuron_source_ami" {
  type        = string
  default     = null
  description = "Neuron DLAMI id to start from instead of the SSM parameter's latest (null: latest)."
}

variable "cuda_source_ami" {
  type        = string
  default     = null
  description = "GPU DLAMI id to start from instead of the SSM parameter's latest (null: latest)."
}

# The builders are small general-purpose instances, not trn2/p5en: nothing in the bake needs an
# accelerator. The EFA installer, the Neuron and NVIDIA driver packages (already in the DLAMIs) and
# vLLM's wheels install without the devices, and the last step, `neuron-disagg doctor --image`,
# checks that the software loads without requiring devices (tests/deploy/test_ami.py runs it on a
# host with none). So a bake needs no Capacity Block and no accelerator quota, starts in any zone
# and costs well under a dollar an hour instead of tens of dollars. m6i: x86_64 Nitro (both DLAMIs
# are x86_64 images with ENA, which boot on it), offered in every commercial region; 8 vCPUs and
# 32 GiB build the EFA kernel module and install vLLM/torch wheels quickly. What only the serving
# hardware can show (devices, EFA) `neuron-disagg doctor` checks on the launched instances.
variable "neuron_instance_type" {
  type        = string
  default     = "m6i.2xlarge"
  description = "Builder for the Trainium AMI: any x86_64 Nitro type (no Trainium needed; see above)."
}

variable "cuda_instance_type" {
  type        = string
  default     = "m6i.2xlarge"
  description = "Builder for the H200 AMI: any x86_64 Nitro type (no GPU needed; see above)."
}

variable "subnet_id" {
  type        = string
  default     = null
  description = "Subnet for the builder (one whose zone has capacity for the builder type); default VPC if null."
}

variable "capacity_reservation_id" {
  type        = string
  default     = null
  description = "Optional capacity reservation (cr-...) for the builder; the default builders need none."
}

variable "nixl_version" {
  type        = string
  default     = "1.4.1"
  description = "NIXL installed by 30-python.sh (exactly this version); tag neuron-disagg:nixl."
}

variable "efa_installer_version" {
  type        = string
  default     = "1.50.0"
  description = "EFA installer 10-efa.sh downloads (GPG-checked) unless the DLAMI's is this version or newer; tag neuron-disagg:efa-installer-min. The exact version is in /etc/neuron-disagg/image-versions on the AMI."
}

variable "doctor_command" {
  type        = string
  default     = ""
  description = "The last provisioning step; the build fails if it exits non-zero. Empty: `neuron-disagg doctor --image --platform <neuron|cuda>` (scripts/90-doctor.sh)."
}

variable "root_volume_gib" {
  type    = number
  default = 200
}

data "amazon-parameterstore" "neuron_dlami" {
  name   = var.neuron_ssm_parameter
  region = var.region
}

data "amazon-parameterstore" "cuda_dlami" {
  name   = var.cuda_ssm_parameter
  region = var.region
}

locals {
  stamp = formatdate("YYYYMMDD-hhmmss", timestamp())
  stage = "/tmp/neuron-disagg-ami"
  # The SSM parameter is always read (it must exist); a pinned id wins.
  neuron_source_ami = coalesce(var.neuron_source_ami, data.amazon-parameterstore.neuron_dlami.value)
  cuda_source_ami   = coalesce(var.cuda_source_ami, data.amazon-parameterstore.cuda_dlami.value)
  tags = {
    "neuron-disagg:version"           = var.package_version
    "neuron-disagg:built"             = local.stamp
    "neuron-disagg:nixl"              = var.nixl_version
    "neuron-disagg:efa-installer-min" = var.efa_installer_version
    # The DLAMI's name carries its release date ("... (Ubuntu 24.04) 20261006"): Packer's build data.
    "neuron-disagg:source-ami-name" = "{{ .SourceAMIName }}"
  }
}

source "amazon-ebs" "neuron" {
  region                  = var.region
  source_ami              = local.neuron_source_ami
  instance_type           = var.neuron_instance_type
  subnet_id               = var.subnet_id
  capacity_reservation_id = var.capacity_reservation_id
  ssh_username            = "ubuntu"
  # Packer's temporary security group lets SSH in from this machine's public address only, not 0.0.0.0/0.
  temporary_security_group_source_public_ip = true
  ami_name                = "neuron-disagg-neuron-${var.package_version}-${local.stamp}"
  ami_description         = "neuron-disagg ${var.package_version} on the Neuron DLAMI: EFA, NIXL ${var.nixl_version}, vLLM (vllm-neuron), units"
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.root_volume_gib
    volume_type           = "gp3"
    delete_on_termination = true
  }
  tags = merge(local.tags, {
    "Name"                     = "neuron-disagg-neuron-${local.stamp}"
    "neuron-disagg:platform"   = "neuron"
    "neuron-disagg:source-ami" = local.neuron_source_ami
  })
}

source "amazon-ebs" "cuda" {
  region                  = var.region
  source_ami              = local.cuda_source_ami
  instance_type           = var.cuda_instance_type
  subnet_id               = var.subnet_id
  capacity_reservation_id = var.capacity_reservation_id
  ssh_username            = "ubuntu"
  temporary_security_group_source_public_ip = true
  ami_name                = "neuron-disagg-cuda-${var.package_version}-${local.stamp}"
  ami_description         = "neuron-disagg ${var.package_version} on the GPU DLAMI: EFA, NIXL ${var.nixl_version}, vLLM, units"
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.root_volume_gib
    volume_type           = "gp3"
    delete_on_termination = true
  }
  tags = merge(local.tags, {
    "Name"                     = "neuron-disagg-cuda-${local.stamp}"
    "neuron-disagg:platform"   = "cuda"
    "neuron-disagg:source-ami" = local.cuda_source_ami
  })
}

build {
  sources = ["source.amazon-ebs.neuron", "source.amazon-ebs.cuda"]

  # Everything the scripts need, staged on the builder: the units, the boot-time script and the
  # wheel (which carries the libcuda stub's source; 40-fabric-libs.sh builds it on Trainium with the
  # package's own command).
  provisioner "shell" {
    inline = ["mkdir -p ${local.stage}/units ${local.stage}/boot"]
  }
  provisioner "file" {
    sources     = [var.wheel]
    destination = "${local.stage}/"
  }
  provisioner "file" {
    source      = "${path.root}/units/"
    destination = "${local.stage}/units"
  }
  provisioner "file" {
    source      = "${path.root}/boot/"
    destination = "${local.stage}/boot"
  }

  provisioner "shell" {
    execute_command = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = [
      "PLATFORM=${source.name}", "STAGE=${local.stage}", "NIXL_VERSION=${var.nixl_version}",
      "EFA_VERSION=${var.efa_installer_version}",
    ]
    scripts = [
      "${path.root}/scripts/10-efa.sh",
      "${path.root}/scripts/20-rdma-limits.sh",
      "${path.root}/scripts/30-python.sh",
    ]
  }

  # Both images: on Trainium a libcuda stub, the CUDA runtime and hwloc; on H200 the CUDA runtime
  # and hwloc (the NVIDIA driver has libcuda). The script passes --platform from PLATFORM.
  provisioner "shell" {
    execute_command  = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = ["PLATFORM=${source.name}", "STAGE=${local.stage}"]
    script           = "${path.root}/scripts/40-fabric-libs.sh"
  }

  provisioner "shell" {
    execute_command  = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = ["PLATFORM=${source.name}", "STAGE=${local.stage}", "DOCTOR_COMMAND=${var.doctor_command}"]
    scripts = [
      "${path.root}/scripts/50-units.sh",
      "${path.root}/scripts/90-doctor.sh",
    ]
  }

  provisioner "shell" {
    inline = ["sudo rm -rf ${local.stage}"]
  }
}
